"""The EPP's EDS service as Envoy's xDS client uses it (the fallback list it
makes possible is tested through a real Envoy in test_envoy_e2e.py)."""
from __future__ import annotations

import asyncio

import grpc

from kvyard.common.wire import WORKERS_CLUSTER
from kvyard.epp.pool.endpoints import EndpointSpec


def _addresses(resp) -> list[str]:
    from envoy.config.endpoint.v3 import endpoint_pb2
    cla = endpoint_pb2.ClusterLoadAssignment()
    assert resp.resources[0].Unpack(cla) and cla.cluster_name == WORKERS_CLUSTER
    return [f"{e.endpoint.address.socket_address.address}:"
            f"{e.endpoint.address.socket_address.port_value}"
            for loc in cla.endpoints for e in loc.lb_endpoints]


async def test_eds_streams_the_pool_and_its_changes(epp):
    from envoy.service.discovery.v3 import discovery_pb2
    from envoy.service.endpoint.v3 import eds_pb2_grpc
    app = await epp([EndpointSpec("10.0.0.1:8000"), EndpointSpec("10.0.0.2:8000")])
    reqs: asyncio.Queue = asyncio.Queue()
    reqs.put_nowait(discovery_pb2.DiscoveryRequest(resource_names=[WORKERS_CLUSTER]))

    async def requests():
        while (r := await reqs.get()) is not None:
            yield r

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.ports['ext_proc']}") as ch:
        stream = eds_pb2_grpc.EndpointDiscoveryServiceStub(ch).StreamEndpoints(requests())
        first = await asyncio.wait_for(stream.read(), 5)
        assert _addresses(first) == ["10.0.0.1:8000", "10.0.0.2:8000"]
        reqs.put_nowait(discovery_pb2.DiscoveryRequest(  # the ack
            version_info=first.version_info, response_nonce=first.nonce))
        app.pool.set_source("static", [EndpointSpec("10.0.0.2:8000")])
        second = await asyncio.wait_for(stream.read(), 5)
        assert _addresses(second) == ["10.0.0.2:8000"]
        assert int(second.version_info) > int(first.version_info)
        reqs.put_nowait(None)


async def test_eds_sends_nothing_before_discovery_has_run(epp):
    from envoy.service.discovery.v3 import discovery_pb2
    from envoy.service.endpoint.v3 import eds_pb2_grpc
    app = await epp([])  # no source yet: an empty answer would wipe Envoy's hosts

    async def requests():
        yield discovery_pb2.DiscoveryRequest(resource_names=[WORKERS_CLUSTER])
        await asyncio.Event().wait()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.ports['ext_proc']}") as ch:
        stream = eds_pb2_grpc.EndpointDiscoveryServiceStub(ch).StreamEndpoints(requests())
        read = asyncio.ensure_future(stream.read())
        done, _ = await asyncio.wait({read}, timeout=0.3)
        assert not done
        app.pool.set_source("static", [])  # discovery ran: the pool really is empty
        assert _addresses(await asyncio.wait_for(read, 5)) == []
        stream.cancel()

