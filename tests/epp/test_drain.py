"""A replica's graceful exit (`EppApp.drain`): readiness goes NOT_SERVING first, a stream
open meanwhile is still answered, then the ext_proc port closes."""
from __future__ import annotations

import asyncio
import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvyard.common.wire import DESTINATION_HEADER

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def _readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="readiness"))
        return r.status


async def test_drain_reports_not_ready_then_serves_then_closes(fake_vllm, epp, xp):
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(lambda: app._health.ready, what="ready")
    drained = asyncio.ensure_future(app.drain(notice_s=0.6, grace_s=1.0))
    await xp.wait_for(lambda: app._health.ready is False, timeout=1.0, what="not ready")
    assert await _readiness(app.ports["health"]) == health_pb2.HealthCheckResponse.NOT_SERVING
    # during the notice, whatever the gateway still sends here is routed
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
    assert xp.set_headers(resps[0]).get(DESTINATION_HEADER) == w.address
    await asyncio.wait_for(drained, 5.0)
    try:
        await asyncio.wait_for(xp.exchange(app.ports["ext_proc"],
                                           [xp.headers_msg(xp.chat_headers()),
                                            xp.body_msg(CHAT)]), 3.0)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE
    else:
        raise AssertionError("a drained replica still answered")
