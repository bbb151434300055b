"""The waiting room behind a real Envoy: a held request outlives Envoy's per-message
timeout (the EPP extends it), is served when an endpoint appears, and an EPP that goes
away while requests are held never leaves Envoy's streams hanging."""
from __future__ import annotations

import asyncio

import aiohttp

from kvyard.epp.pool.endpoints import EndpointSpec

from .test_envoy_e2e import _envoy_ready, _openai_error, envoy  # noqa: F401 (fixture)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _post(s: aiohttp.ClientSession, port: int) -> tuple[int, dict]:
    async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
        return r.status, await r.json(content_type=None)


async def test_held_past_envoys_message_timeout_then_served(fake_vllm, epp, envoy, xp):
    app = await epp([])
    port, admin = await envoy(app.ports["ext_proc"], ext_proc_timeout_s=0.5)
    async with aiohttp.ClientSession() as s:
        await _envoy_ready(s, admin)
        held = asyncio.ensure_future(_post(s, port))
        await xp.wait_for(lambda: app.demand.parked["decode"] == 1, timeout=10, what="parked")
        # Held well past the 0.5 s Envoy allows one EPP answer by default.
        await xp.wait_for(lambda: app.flow.snapshot()["oldest_wait_s"] > 1.5, timeout=10,
                          what="held 1.5 s")
        assert not held.done()
        w = await fake_vllm()
        app.pool.set_source("static", [EndpointSpec(w.address)])
        status, body = await asyncio.wait_for(held, 10)
        assert status == 200 and body["served_by"] == w.address


async def test_epp_gone_while_held_fails_streams_cleanly(epp, envoy, xp):
    """A graceful stop answers held requests with 503 + retry-after; a crash (the stream
    cut) is Envoy's 503 in OpenAI's shape. Neither hangs."""
    graceful = await epp([])
    crashed = await epp([])
    g_port, g_admin = await envoy(graceful.ports["ext_proc"])
    c_port, c_admin = await envoy(crashed.ports["ext_proc"])
    async with aiohttp.ClientSession() as s:
        await _envoy_ready(s, g_admin)
        await _envoy_ready(s, c_admin)
        g = [asyncio.ensure_future(_post(s, g_port)) for _ in range(2)]
        c = [asyncio.ensure_future(_post(s, c_port)) for _ in range(2)]
        await xp.wait_for(lambda: graceful.demand.parked["decode"] == 2
                          and crashed.demand.parked["decode"] == 2, timeout=10, what="parked")
        await graceful.stop()
        await crashed._grpc.stop(0)  # no goodbye: the streams are cut
        for status, body in await asyncio.wait_for(asyncio.gather(*g), 10):
            assert status == 503 and body["error"]["code"] == "rejected-shutting-down"
        for status, body in await asyncio.wait_for(asyncio.gather(*c), 10):
            assert status == 503 and body["error"]["code"] == "endpoint_picker_unavailable"
        assert crashed.demand.parked["decode"] == 0  # the cut streams left the queue
