"""The scaler inside a running EPP: a request that reaches the pool at zero endpoints
(over ext_proc, as Envoy sends it) flips StreamIsActive within 100 ms, the metric
counts it while it waits, and both drop back once an endpoint serves it."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import grpc

from kvyard.common import keda
from kvyard.common.wire import DESTINATION_HEADER
from kvyard.epp.pool.endpoints import EndpointSpec

pb2 = keda.pb2
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "wake up"}]}).encode()


async def test_request_at_zero_endpoints_wakes_the_stream_within_100ms(epp, fake_vllm, xp):
    app = await epp([], scaler_port=0)
    scaler_port = app.ports["scaler"]
    assert app.scaler is not None and app.scaler.port == scaler_port
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{scaler_port}")
    stub = keda.pb2_grpc.ExternalScalerStub(ch)
    ref = pb2.ScaledObjectRef(name="workers", namespace="ns", scalerMetadata={
        "pool": app.cfg.pool_name, "role": "both"})
    req = pb2.GetMetricsRequest(scaledObjectRef=ref)
    stream = stub.StreamIsActive(ref)
    try:
        async with aiohttp.ClientSession() as http:  # what `kvyard status` and Prometheus read
            base = f"http://127.0.0.1:{app.ports['metrics']}"
            async with http.get(base + "/debug/endpoints") as r:
                sc = (await r.json())["scaler"]
            async with http.get(base + "/metrics") as r:
                prom = await r.text()
        assert (sc["pool"], sc["port"]) == (app.cfg.pool_name, scaler_port)
        assert 'kvyard_epp_scaler_metric{pool="default",role="both"} 0.0' in prom
        assert (await asyncio.wait_for(stream.read(), 5)).result is False
        assert (await stub.GetMetrics(req)).metricValues[0].metricValueFloat == 0.0
        t0 = time.monotonic()
        held = asyncio.create_task(xp.exchange(app.ports["ext_proc"], [
            xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)]))
        woke = await asyncio.wait_for(stream.read(), 5)
        took = time.monotonic() - t0
        assert woke.result is True
        assert took < 0.1, f"StreamIsActive took {took * 1000:.1f} ms after the request"
        assert not held.done()  # parked, not refused
        assert (await stub.IsActive(ref)).result is True
        assert (await stub.GetMetrics(req)).metricValues[0].metricValueFloat > 0.0
        w = await fake_vllm()  # the pool scales up: the parked request is dispatched to it
        app.pool.set_source("static", [EndpointSpec(w.address)])
        resps = await asyncio.wait_for(held, 10)
        routed = [r for r in resps if r.HasField("request_headers")]  # after the hold's keep-alives
        assert [xp.set_headers(r).get(DESTINATION_HEADER) for r in routed] == [w.address]
        assert app.demand.waiting("decode") == 0
        # the pick counts on its endpoint (`pending`) until a scrape shows the worker idle
        deadline = time.monotonic() + 5
        while (await stub.GetMetrics(req)).metricValues[0].metricValueFloat > 0.0:
            assert time.monotonic() < deadline, "metric still > 0 with nothing held or running"
            await asyncio.sleep(0.01)
        assert (await stub.IsActive(ref)).result is False
    finally:
        stream.cancel()
        await ch.close()
