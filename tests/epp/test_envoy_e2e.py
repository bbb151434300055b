"""The EPP behind a real Envoy (the gateway's own bootstrap): proves the
pinned protocol — headers SEND, body STREAMED behind the buffer filter
(whole body in one chunk), routing answered on the headers message once the
body is in — end to end."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time

import aiohttp
import pytest

from kvyard.gateway.config import GatewayConfig
from kvyard.gateway.envoy import EnvoyNotFound, envoy_binary, envoy_command, write_config


@pytest.fixture
async def envoy(free_port, tmp_path):
    try:
        envoy_binary()
    except EnvoyNotFound as e:
        pytest.skip(str(e))
    procs = []

    async def start(ext_proc_port: int, **kw) -> int:
        port, admin = free_port(), free_port()
        cfg = GatewayConfig(listen_port=port, epp_address=f"127.0.0.1:{ext_proc_port}",
                            admin_port=admin, **kw)
        path = write_config(cfg, tmp_path / f"envoy-{port}.yaml")
        procs.append(subprocess.Popen(envoy_command(path),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return port, admin

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


async def _envoy_ready(s: aiohttp.ClientSession, admin: int) -> None:
    async def ready() -> bool:
        try:
            async with s.get(f"http://127.0.0.1:{admin}/ready") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False
    deadline = time.monotonic() + 30  # Envoy starts slowly on a busy machine
    while not await ready():
        assert time.monotonic() < deadline, "envoy never became ready"
        await asyncio.sleep(0.05)  # the readiness probe's poll period


def _openai_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["code"], str) and isinstance(err["message"], str)
    return err


async def test_every_gateway_error_has_openai_shape(fake_vllm, epp, envoy, xp, free_port):
    """Envoy's own replies (413 from the buffer filter, 503 with the EPP down) are
    rewritten to OpenAI's shape; the EPP's JSON errors pass through unchanged."""
    w = await fake_vllm()
    app = await epp([w])
    port, admin = await envoy(app.ports["ext_proc"], body_limit_bytes=10_000)
    dead_port, dead_admin = await envoy(free_port())  # an EPP address nobody listens on
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        await _envoy_ready(s, admin)
        await _envoy_ready(s, dead_admin)
        await xp.wait_for(app.is_ready, what="EPP ready")
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=big) as r:
            assert r.status == 413 and r.content_type == "application/json"
            err = _openai_error(await r.read())
            assert err["code"] == "request_too_large" and "10000" in err["message"]
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                          data=b'{"model": "m", "prompt": "\\ud800"}') as r:
            assert r.status == 400  # the EPP's own body, not re-wrapped
            assert _openai_error(await r.read())["code"] == "invalid_encoding"
        async with s.post(f"http://127.0.0.1:{dead_port}/v1/chat/completions", json=chat) as r:
            assert r.status == 503 and r.content_type == "application/json"
            assert r.headers["retry-after"] == "1"
            err = _openai_error(await r.read())
            assert err["code"] == "endpoint_picker_unavailable"
            assert err["type"] == "server_error"
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat) as r:
            assert r.status == 200


async def test_requests_reach_the_picked_worker_through_envoy(fake_vllm, epp, envoy, xp):
    w1, w2 = await fake_vllm(), await fake_vllm()
    app = await epp([w1, w2])
    port, admin = await envoy(app.ports["ext_proc"])
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        await _envoy_ready(s, admin)
        await xp.wait_for(app.is_ready, what="EPP ready")

        forged = {"x-gateway-destination-endpoint": "6.6.6.6:80",
                  "x-prefiller-host-port": "6.6.6.6:81"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi " * 50_000}]}
        async with s.post(base + "/v1/chat/completions", json=chat, headers=forged) as r:
            assert r.status == 200
            got = await r.json()
        assert got["served_by"] in (w1.address, w2.address)
        assert got["headers"]["x-gateway-destination-endpoint"] == got["served_by"]
        assert "x-prefiller-host-port" not in got["headers"]
        assert got["body_bytes"] == len(json.dumps(chat))

        async with s.get(base + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["served_by"] in (w1.address, w2.address)
        async with s.post(base + "/v1/chat/completions", data=b"{nope",
                          headers={"content-type": "application/json"}) as r:
            assert r.status == 400
            assert "not valid JSON" in (await r.json())["error"]["message"]
        bad_model = {"model": "other", "messages": [{"role": "user", "content": "x"}]}
        async with s.post(base + "/v1/chat/completions", json=bad_model) as r:
            assert r.status == 404


async def test_a_worker_dead_since_the_decision_costs_no_request(fake_vllm, epp, envoy, xp):
    """The EPP lists a fallback after its pick; Envoy (hosts from the EPP's EDS) retries
    on it when the pick refuses the connection, before the EPP has noticed anything."""
    w1, w2 = await fake_vllm(), await fake_vllm(waiting=3)
    app = await epp([w1, w2], destination_fallbacks=1, scrape_interval=0.05)
    port, admin = await envoy(app.ports["ext_proc"])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        await _envoy_ready(s, admin)
        await xp.wait_for(lambda: app.pool.get(w2.address).waiting == 3, what="scrape")
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat) as r:
            got = await r.json()
        assert got["served_by"] == w1.address  # the shorter queue
        assert got["headers"]["x-gateway-destination-endpoint"] == f"{w1.address},{w2.address}"
        app.cfg.scrape_interval = 3600  # the EPP must not learn of the death before the request
        for task in app._tasks:
            task.cancel()
        await w1.stop()
        for _ in range(5):
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat) as r:
                assert r.status == 200
                assert (await r.json())["served_by"] == w2.address
        assert not app.pool.get(w1.address).down
