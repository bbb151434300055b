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
# gRPC servers bind with SO_REUSEPORT unless told otherwise: a second server on the same
# port (another process of the same user, or this one's ext_proc and health servers
# handed one port twice) then binds too and silently takes a share of the connections
# (seen in CI: ext_proc calls answered UNIMPLEMENTED by the health server). Off: a taken
# port fails to bind, loudly.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def bind(server: grpc.aio.Server, host: str, port: int, what: str,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """The bound port (TLS with `credentials`), or OSError naming `what` (grpcio returns 0
    or raises, by version)."""
    try:
        bound = (server.add_insecure_port(f"{host}:{port}") if credentials is None
                 else server.add_secure_port(f"{host}:{port}", credentials))
    except RuntimeError as e:
        raise OSError(f"cannot bind {what} port {port}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot bind {what} port {port}")
    return bound


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
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        bind(self._server, self.host, self.port, "health")
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
