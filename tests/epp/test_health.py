"""gRPC health and the HTTP debug/metrics views of a running EPP."""
from __future__ import annotations

import json

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


async def _status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
        return r.status


async def test_readiness_flips_with_known_fresh_endpoints(fake_vllm, epp, xp, tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text("[]\n")
    app = await epp(endpoints_file=str(f))
    hp = app.ports["health"]
    assert await _status(hp, "liveness") == SERVING
    assert await _status(hp, "envoy.service.ext_proc.v3.ExternalProcessor") == SERVING
    assert await _status(hp, "readiness") != SERVING
    w = await fake_vllm()
    f.write_text(f"- {w.address}\n")
    await xp.wait_for(lambda: app._health.ready, what="ready")
    assert await _status(hp, "readiness") == SERVING
    await w.stop()
    await xp.wait_for(lambda: app._health.ready is False, what="not ready")
    assert await _status(hp, "readiness") != SERVING


async def test_debug_endpoints_and_prometheus(fake_vllm, epp, xp):
    w = await fake_vllm(waiting=2, running=3, kv=0.25)
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="ready")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 600}]})
    await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(xp.chat_headers()),
                                              xp.body_msg(body.encode())])
    base = f"http://127.0.0.1:{app.ports['metrics']}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/debug/endpoints") as r:
            data = await r.json()
        async with s.get(base + "/metrics") as r:
            prom = await r.text()
    (e,) = data["endpoints"]
    assert (e["address"], e["queue"], e["running"], e["kv_usage"], e["picks"]) == \
        (w.address, 2, 3, 0.25, 1)
    assert e["fresh"] is True and e["role"] == "both" and "prefix_hits" in e
    assert data["ready"] is True and data["prefix_hash"] == "bytes"
    assert "kvyard_epp_decision_seconds_count 1.0" in prom
    assert f'kvyard_epp_picks_total{{endpoint="{w.address}"}} 1.0' in prom
    assert "kvyard_epp_prefix_hit_ratio_bucket" in prom


async def test_a_taken_grpc_port_fails_to_bind_instead_of_sharing(free_port):
    """gRPC's default SO_REUSEPORT would let a second server bind the EPP's port and take
    a share of its connections (CI once saw ext_proc calls answered by the health
    server); ours are bound exclusively, so the second bind fails loudly."""
    import pytest

    from kvyard.epp.health import HealthServer

    port = free_port()
    first = HealthServer(port, lambda: True, host="127.0.0.1")
    await first.start()
    try:
        second = HealthServer(port, lambda: True, host="127.0.0.1")
        with pytest.raises(OSError, match="cannot bind health port"):
            await second.start()
        assert await _status(port, "liveness") == SERVING  # the first still serves
    finally:
        await first.stop()
