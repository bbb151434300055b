"""EDS for the gateway: the EPP tells Envoy which endpoints exist.

The gateway's workers cluster is an EDS cluster fed by this service (on the
EPP's ext_proc port), load-balanced by Envoy's override-host policy: the
EPP's `x-gateway-destination-endpoint` answer names hosts of that cluster,
in order, and a request whose connection fails or is reset before its
response starts is retried on the next one. So a worker killed between the
decision and the connection costs no request, and Envoy can only ever reach
pool members (a forged destination cannot make it connect elsewhere).

State of the world over one stream: each response carries the whole pool
as one ClusterLoadAssignment, versioned by the pool's generation; a new one
is pushed when membership changes. Nothing is sent before discovery has run
once, so a restarted EPP never tells Envoy the pool is empty. Envoy keeps
the last assignment while the EPP is away.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

from envoy.config.core.v3 import address_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2

from kvyard.common.wire import WORKERS_CLUSTER

from .pool.endpoints import EndpointPool

log = logging.getLogger("kvyard.epp.xds")
TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def assignment(pool: EndpointPool, cluster: str = WORKERS_CLUSTER) -> endpoint_pb2.ClusterLoadAssignment:
    lbs = []
    for ep in sorted(pool.all(), key=lambda e: e.address):
        host, _, port = ep.address.rpartition(":")
        sock = address_pb2.SocketAddress(address=host.strip("[]"), port_value=int(port))
        lbs.append(endpoint_components_pb2.LbEndpoint(endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(socket_address=sock))))
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster, endpoints=[endpoint_components_pb2.LocalityLbEndpoints(
            lb_endpoints=lbs)])


@dataclass(slots=True)
class EdsServicer(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    pool: EndpointPool
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    streams: int = 0

    def notify(self) -> None:
        """Pool membership changed (EndpointPool.on_change)."""
        self._changed.set()

    def _response(self, nonce: int) -> discovery_pb2.DiscoveryResponse:
        res = any_pb2.Any()
        res.Pack(assignment(self.pool))
        return discovery_pb2.DiscoveryResponse(version_info=str(self.pool.generation),
                                               resources=[res], type_url=TYPE_URL,
                                               nonce=str(nonce))

    async def StreamEndpoints(self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
                              context) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        self.streams += 1
        requests: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for req in request_iterator:
                if req.HasField("error_detail"):
                    log.warning("Envoy refused endpoints version %s: %s", req.version_info,
                                req.error_detail.message)
                requests.put_nowait(req)
            requests.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            if await requests.get() is None:
                return
            while self.pool.generation == 0:  # discovery has not run yet
                await self._wait_change()
            nonce, sent = 0, -1
            while True:
                if self.pool.generation != sent:
                    nonce += 1
                    sent = self.pool.generation
                    yield self._response(nonce)
                await self._wait_change()
        finally:
            reader.cancel()
            self.streams -= 1

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()
