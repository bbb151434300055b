"""gRPC health on its own port, as GAIE gateways and kubelet probes expect.

Services: `liveness` (the process serves), the ext_proc service name (same),
and `readiness`: endpoints are known and at least one has fresh metrics.
Readiness is re-evaluated on a short timer because freshness decays with
time, not with events.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(slots=True)
class HealthServer:
    port: int
    is_ready: Callable[[], bool]
    host: str = "0.0.0.0"
    period: float = 0.1
    _server: grpc.aio.Server | None = None
    _servicer: health.aio.HealthServicer | None = None
    _task: asyncio.Task | None = None
    ready: bool | None = None

    async def start(self) -> None:
        self._servicer = health.aio.HealthServicer()
        self._server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        if self._server.add_insecure_port(f"{self.host}:{self.port}") == 0:
            raise OSError(f"cannot bind health port {self.port}")
        for name in ("liveness", EXT_PROC_SERVICE):
            await self._servicer.set(name, _SERVING)
        await self._update()
        await self._server.start()
        self._task = asyncio.create_task(self._loop())

    async def _update(self) -> None:
        ready = bool(self.is_ready())
        if ready != self.ready and self._servicer is not None:
            self.ready = ready
            await self._servicer.set("readiness", _SERVING if ready else _NOT_SERVING)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period)  # freshness decays with time
            await self._update()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._servicer is not None:
            await self._servicer.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(0.5)
