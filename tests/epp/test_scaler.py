"""The EPP's KEDA external scaler through a real grpc.aio client, as KEDA calls it."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvyard.common import keda
from kvyard.epp.flow.demand import Demand
from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec
from kvyard.epp.scaler.server import ScalerConfig, ScalerServer

pb2 = keda.pb2
POOL = "llama"


def ref(role: str = "decode", **meta: str) -> pb2.ScaledObjectRef:
    return pb2.ScaledObjectRef(name=f"workers-{role}", namespace="ns",
                               scalerMetadata={"pool": POOL, "role": role,
                                               "scalerAddress": "epp:9004", **meta})


@pytest.fixture
async def scaler():
    made: list[tuple[ScalerServer, grpc.aio.Channel]] = []

    async def make(pool: EndpointPool | None = None, demand: Demand | None = None, **cfg):
        s = ScalerServer(pool or EndpointPool(), demand or Demand(), POOL, ScalerConfig(**cfg))
        port = await s.start("127.0.0.1", 0)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        made.append((s, ch))
        return s, keda.pb2_grpc.ExternalScalerStub(ch)

    yield make
    for s, ch in made:
        await ch.close()
        await s.stop()


async def metric(stub, r: pb2.ScaledObjectRef) -> float:
    spec = await stub.GetMetricSpec(r)
    name = spec.metricSpecs[0].metricName
    got = await stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=r, metricName=name))
    assert [v.metricName for v in got.metricValues] == [name]
    return got.metricValues[0].metricValueFloat


async def read(call, timeout: float = 5.0):
    """One message off a stream; a stream that stays silent fails the test, never hangs it."""
    return await asyncio.wait_for(call.read(), timeout)


def pool_with(*eps: tuple[str, str]) -> EndpointPool:
    pool = EndpointPool()
    pool.set_source("static", [EndpointSpec(a, r) for a, r in eps])
    for e in pool.all():  # as a good scrape leaves them
        e.last_ok = time.monotonic()
    return pool


async def test_metrics_present_and_zero_at_zero_pods(scaler):
    _, stub = await scaler()
    for role in ("both", "decode", "prefill"):
        spec = await stub.GetMetricSpec(ref(role))
        assert [(m.metricName, m.targetSize, m.targetSizeFloat) for m in spec.metricSpecs] == [
            (f"kvyard-{POOL}-{role}", 1, 1.0)]
        got = await stub.GetMetrics(pb2.GetMetricsRequest(
            scaledObjectRef=ref(role), metricName=f"s0-kvyard-{POOL}-{role}"))
        assert [(v.metricName, v.metricValue, v.metricValueFloat) for v in got.metricValues] == [
            (f"s0-kvyard-{POOL}-{role}", 0, 0.0)]
        assert (await stub.IsActive(ref(role))).result is False


async def test_requests_held_at_zero_pods_make_the_metric_positive(scaler):
    demand = Demand()
    _, stub = await scaler(demand=demand)
    demand.parked["decode"] = 3
    for role in ("decode", "both"):
        assert (await stub.IsActive(ref(role))).result is True
        m = await metric(stub, ref(role))
        assert 0 < m < 1  # one replica serves three requests (the fallback capacity)
        got = await stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=ref(role)))
        assert got.metricValues[0].metricValue == 1  # int field for KEDA < 2.17: rounded up
    assert (await stub.IsActive(ref("prefill"))).result is False
    assert await metric(stub, ref("prefill")) == 0.0
    demand.parked["prefill"], demand.parked["decode"] = 2, 0
    assert (await stub.IsActive(ref("prefill"))).result is True
    assert await metric(stub, ref("prefill")) > 0
    assert (await stub.IsActive(ref("decode"))).result is False


async def test_metric_follows_endpoint_load(scaler):
    pool = pool_with(("10.0.0.1:8000", "decode"), ("10.0.0.2:8000", "decode"),
                     ("10.0.0.3:8000", "prefill"))
    _, stub = await scaler(pool=pool)
    d1, d2, p1 = (pool.get(f"10.0.0.{i}:8000") for i in (1, 2, 3))
    assert await metric(stub, ref("decode")) == 0.0
    assert (await stub.IsActive(ref("decode"))).result is False
    readings = []
    for running in (2, 8, 16, 32):
        d1.running = d2.running = running
        readings.append(await metric(stub, ref("decode")))
    assert readings == sorted(readings) and readings[0] > 0 and readings[-1] > 2 * readings[1]
    assert (await stub.IsActive(ref("decode"))).result is True
    d1.running = d2.running = 1
    d1.kv_usage = d2.kv_usage = 0.8  # KV-bound: two replicas at the 0.8 target
    assert await metric(stub, ref("decode")) == pytest.approx(2.0)
    d1.kv_usage = d2.kv_usage = 0.4
    assert await metric(stub, ref("decode")) == pytest.approx(1.0)
    assert await metric(stub, ref("decode", kvTarget="0.2")) == pytest.approx(4.0)
    # prefill: prompt backlog over (rate x TTFT objective); a tighter objective needs more
    assert await metric(stub, ref("prefill")) == 0.0
    p1.waiting = 4
    base = await metric(stub, ref("prefill"))
    assert base > 0 and (await stub.IsActive(ref("prefill"))).result is True
    assert await metric(stub, ref("prefill", ttftMs="250")) == pytest.approx(4 * base)
    p1.pending = 4  # picks the scrape has not seen yet count too
    assert await metric(stub, ref("prefill")) == pytest.approx(2 * base)
    # a down endpoint's stale numbers are not demand
    d1.down = d2.down = True
    assert await metric(stub, ref("decode")) == 0.0


async def test_stream_is_active_fires_within_100ms_of_an_arrival_at_an_empty_role(scaler):
    demand = Demand()
    s, stub = await scaler(demand=demand, stream_interval_s=60.0)
    streams = {role: stub.StreamIsActive(ref(role)) for role in ("decode", "both", "prefill")}
    for role, st in streams.items():
        assert (await read(st)).result is False  # the current state, at once
    # what flow control does when a request reaches a role with no ready endpoint
    demand.parked["decode"] += 1
    t0 = time.monotonic()
    demand.notify("decode")
    got = await asyncio.gather(read(streams["decode"]), read(streams["both"]))
    took = time.monotonic() - t0
    assert [r.result for r in got] == [True, True]
    assert took < 0.1, f"StreamIsActive took {took * 1000:.1f} ms"
    assert s.servicer.pushes == 2  # the prefill stream was not woken
    demand.parked["prefill"] += 1
    t0 = time.monotonic()
    demand.notify("prefill")
    assert (await read(streams["prefill"])).result is True
    assert time.monotonic() - t0 < 0.1
    for st in streams.values():
        st.cancel()


async def test_stream_resends_the_current_activity_periodically(scaler):
    demand = Demand()
    _, stub = await scaler(demand=demand, stream_interval_s=0.05)
    st = stub.StreamIsActive(ref("both"))
    assert [(await read(st)).result for _ in range(3)] == [False] * 3
    demand.queued["decode"] = 1  # saturated, not parked: no notification, the period tells
    seen = [(await read(st)).result for _ in range(3)]
    assert seen[-1] is True
    st.cancel()


async def test_many_streams_and_client_disconnects(scaler):
    demand = Demand()
    s, _ = await scaler(demand=demand, stream_interval_s=60.0)
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for _ in range(4)]
    calls = [keda.pb2_grpc.ExternalScalerStub(chans[i % 4]).StreamIsActive(ref("decode"))
             for i in range(64)]
    for c in calls:
        assert (await read(c)).result is False
    assert len(s.servicer.streams["decode"]) == 64
    for c in calls[:32]:
        c.cancel()
    await chans[3].close()  # a client that goes away without cancelling
    deadline = time.monotonic() + 5
    while len(s.servicer.streams["decode"]) > 24 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert len(s.servicer.streams["decode"]) == 24  # 64 - 32 cancelled - 8 on the closed channel
    demand.notify("decode")
    alive = [c for i, c in enumerate(calls) if i >= 32 and i % 4 != 3]
    assert [r.result for r in await asyncio.gather(*(read(c) for c in alive))] == [True] * 24
    for c in alive:
        c.cancel()
    for ch in chans[:3]:
        await ch.close()
    deadline = time.monotonic() + 5
    while s.servicer.streams["decode"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not s.servicer.streams["decode"]


async def test_unknown_pool_is_not_found(scaler):
    _, stub = await scaler()
    other = pb2.ScaledObjectRef(name="w", namespace="ns",
                                scalerMetadata={"pool": "other", "role": "decode"})
    for call in (stub.IsActive(other), stub.GetMetricSpec(other),
                 stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=other))):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'llama', not 'other'" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.StreamIsActive(other).read()
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as e:  # a metric this ScaledObject does not have
        await stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=ref(), metricName="s0-x"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("meta, says", [
    ({"role": "decode"}, "pool is required"),
    ({"pool": POOL}, "role"),
    ({"pool": POOL, "role": "gpu"}, "role: 'gpu'"),
    ({"pool": POOL, "role": "decode", "targetValue": "abc"}, "targetValue: 'abc' is not a number"),
    ({"pool": POOL, "role": "decode", "targetValue": "0"}, "targetValue: '0' must be > 0"),
    ({"pool": POOL, "role": "decode", "targetValue": "inf"}, "targetValue"),
    ({"pool": POOL, "role": "decode", "ttftMs": "-5"}, "ttftMs"),
    ({"pool": POOL, "role": "decode", "kvTarget": "1.5"}, "kvTarget: '1.5' must be in (0, 1]"),
    ({"pool": POOL, "role": "decode", "targetvalue": "2"}, "unknown key(s) targetvalue"),
])
async def test_bad_metadata_is_invalid_argument(scaler, meta, says):
    _, stub = await scaler()
    r = pb2.ScaledObjectRef(name="w", namespace="ns", scalerMetadata=meta)
    for call in (stub.IsActive(r), stub.GetMetricSpec(r),
                 stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=r))):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in e.value.details() and "ns/w" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.StreamIsActive(r).read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_target_value_from_metadata(scaler):
    _, stub = await scaler()
    spec = await stub.GetMetricSpec(ref("both", targetValue="0.8"))
    assert [(m.targetSize, m.targetSizeFloat) for m in spec.metricSpecs] == [(1, 0.8)]
    spec = await stub.GetMetricSpec(ref("both", targetValue="2.5"))
    assert [(m.targetSize, m.targetSizeFloat) for m in spec.metricSpecs] == [(2, 2.5)]


async def test_taken_port_fails_to_start(scaler):
    s, _ = await scaler()
    other = ScalerServer(EndpointPool(), Demand(), POOL)
    with pytest.raises(OSError, match="scaler port"):
        await other.start("127.0.0.1", s.port)
    await other.stop()


async def test_readings_on_the_epp_registry_present_from_the_start():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    demand = Demand()
    s = ScalerServer(EndpointPool(), demand, POOL)
    reg = CollectorRegistry()
    s.register(reg)

    def samples() -> dict:
        return {(x.name, x.labels["role"]): x.value
                for f in text_string_to_metric_families(generate_latest(reg).decode())
                for x in f.samples}

    assert samples() == {(n, r): 0.0 for n in ("kvyard_epp_scaler_metric",
                                               "kvyard_epp_scaler_active")
                         for r in ("prefill", "decode", "both")}
    demand.parked["decode"] = 1
    got = samples()
    assert got[("kvyard_epp_scaler_active", "decode")] == 1.0
    assert got[("kvyard_epp_scaler_metric", "both")] > 0.0
    assert got[("kvyard_epp_scaler_active", "prefill")] == 0.0


async def test_prefill_backlog_is_the_workers_own_pending_prompt_tokens(scaler):
    """A kvyard worker exports kvyard:prompt_tokens_pending: the backlog is that, not its
    queue times an estimated prompt length (so a few long prompts weigh what they cost)."""
    pool = pool_with(("10.0.0.3:8000", "prefill"))
    _, stub = await scaler(pool=pool)
    p1 = pool.get("10.0.0.3:8000")
    p1.prompt_tokens_pending = 0.0
    p1.waiting = 3  # the gauge says they are computed already: no backlog
    assert await metric(stub, ref("prefill")) == 0.0
    p1.prompt_tokens_pending = 4000.0
    one = await metric(stub, ref("prefill"))
    assert one > 0
    p1.prompt_tokens_pending = 8000.0
    assert await metric(stub, ref("prefill")) == pytest.approx(2 * one)
