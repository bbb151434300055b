"""scalerMetadata `signal` and `leadMs` through a real grpc.aio client: the predictive
signal reports the larger of the backlog and the arrival forecast over `leadMs`, the
backlog signal the backlog alone; the colocated forecast takes the larger of its prefill
and decode terms."""
from __future__ import annotations

import grpc
import pytest

from kvyard.common import keda
from kvyard.epp.flow.demand import Demand
from kvyard.epp.pool.endpoints import EndpointPool
from kvyard.epp.scaler.meta import MetadataError, ScalerDefaults, parse_metadata
from kvyard.epp.scaler.predictive import Forecast, required_replicas
from kvyard.epp.scaler.server import ScalerConfig, ScalerServer

pb2 = keda.pb2
POOL = "llama"


def ref(**meta: str) -> pb2.ScaledObjectRef:
    return pb2.ScaledObjectRef(name="workers", namespace="ns",
                               scalerMetadata={"pool": POOL, "role": "both", **meta})


async def metric(stub, r: pb2.ScaledObjectRef) -> float:
    name = (await stub.GetMetricSpec(r)).metricSpecs[0].metricName
    got = await stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=r, metricName=name))
    return got.metricValues[0].metricValueFloat


def test_signal_and_lead_parse_and_bad_values_are_refused() -> None:
    d = ScalerDefaults()
    p = parse_metadata({"pool": POOL, "role": "both"}, d)
    assert p.predictive and p.lead_s == 60.0
    p = parse_metadata({"pool": POOL, "role": "both", "signal": "backlog", "leadMs": "90000"}, d)
    assert not p.predictive and p.lead_s == 90.0
    assert p.metadata()["signal"] == "backlog" and p.metadata()["leadMs"] == "90000"
    with pytest.raises(MetadataError, match="signal: 'reactive' must be one of"):
        parse_metadata({"pool": POOL, "role": "both", "signal": "reactive"}, d)
    with pytest.raises(MetadataError, match="leadMs: '-5' must be > 0"):
        parse_metadata({"pool": POOL, "role": "both", "leadMs": "-5"}, d)


def test_the_forecast_extrapolates_from_the_window_centre_and_takes_the_larger_term() -> None:
    f = Forecast(rate=10.0, trend=0.1, prompt_tokens=1000.0, output_tokens=100.0, age_s=15.0)
    # rate' = 10 + 0.1 * (45 + 15) = 16; prefill 16 * 1000 / 4000 = 4; decode 16*100*0.05/16
    assert required_replicas(f, "prefill", 4000.0, 16.0, 0.05, 45.0) == pytest.approx(4.0)
    assert required_replicas(f, "decode", 4000.0, 16.0, 0.05, 45.0) == pytest.approx(5.0)
    assert required_replicas(f, "both", 4000.0, 16.0, 0.05, 45.0) == pytest.approx(5.0)
    # a falling trend is not extrapolated: the window's mean rate stands
    falling = Forecast(8.0, -1.0, 1000.0, 100.0, age_s=15.0)
    assert required_replicas(falling, "prefill", 4000.0, 16.0, 0.05, 45.0) == 2.0


async def test_backlog_signal_leaves_the_forecast_out() -> None:
    s = ScalerServer(EndpointPool(), Demand(), POOL, ScalerConfig())
    s.servicer.forecast = lambda role: Forecast(10.0, 0.1, 1000.0, 50.0)
    port = await s.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = keda.pb2_grpc.ExternalScalerStub(ch)
            near = await metric(stub, ref(leadMs="10000"))
            far = await metric(stub, ref(leadMs="100000"))
            assert 0.0 < near < far  # a longer lead reaches further up the trend
            assert await metric(stub, ref(signal="backlog")) == 0.0  # no endpoints, no queue
            assert (await stub.IsActive(ref())).result  # arrivals make it active
            assert not (await stub.IsActive(ref(signal="backlog"))).result
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await metric(stub, ref(signal="bogus"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await s.stop()


def _windows(pending_tokens: float) -> bool:
    """Two 1-s windows of a pod running 2 requests whose generated tokens advance; with
    `pending_tokens` both are mid-prefill. Whether a TPOT sample was taken."""
    from kvyard.epp.pool.endpoints import Endpoint
    from kvyard.epp.pool.metrics_parse import WorkerMetrics
    from kvyard.epp.scaler.capacity import Capacity

    cap, ep = Capacity(window_s=1.0), Endpoint("10.0.0.1:8000")
    for i in range(5):
        cap.observe(ep, WorkerMetrics(running=2, prompt_tokens=1000.0 * i,
                                      generation_tokens=50.0 * i, finished=2.0 * i,
                                      prompt_tokens_pending=pending_tokens), now=0.5 * i)
    return cap.role("both").decode_measured


def test_requests_mid_prefill_are_not_counted_as_decoding() -> None:
    assert _windows(pending_tokens=0.0)
    # 2 x the measured prompt length pending and nothing waiting: both running requests
    # are mid-prefill, so the tokens generated meanwhile say nothing about their TPOT
    assert not _windows(pending_tokens=1000.0)
