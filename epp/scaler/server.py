"""KEDA's external scaler (`externalscaler.ExternalScaler`), served by the EPP.

KEDA scales each worker pool (one ScaledObject per role) from what the EPP
knows first: the requests it holds and the endpoints' live load. The trigger
is `external-push`, so KEDA keeps a `StreamIsActive` stream open and a pool at
zero wakes the moment a request arrives, not at the next poll (30 s by
default); scaling down and between 1 and N go through `IsActive` and
`GetMetrics` as KEDA polls. protocols.md §6 has the protocol facts; the stubs
come from `kvyard.common.keda`.

* `scalerMetadata`: `pool` (must be this EPP's `--pool-name`, else NOT_FOUND),
  `role` (`both|decode|prefill`), optional `targetValue`, `ttftMs`, `tpotMs`,
  `kvTarget`, `signal` (`predictive|backlog`), `leadMs`; `meta.py` documents them.
  Bad metadata is INVALID_ARGUMENT.
* Metric (`GetMetricSpec` / `GetMetrics`): one per ScaledObject, named
  `kvyard-<pool>-<role>`, in replicas' worth of demand; the formula is in
  `metric.py`, the capacity it divides by is measured in `capacity.py`.
  It exists, with value 0, for a pool with no pods.
* `IsActive`: the role's endpoints have work, or requests wait for the role.
* `StreamIsActive`: the current activity at once and every `stream_interval_s`,
  and `true` as soon as flow control reports a request at an empty role
  (`Demand.notify`): a `decode` arrival wakes `decode` and `both` streams, a
  `prefill` one `prefill` streams. One Demand subscription fans out to every
  open stream; a stream that the client drops (or the server stops) leaves the
  fan-out in its `finally`.

The int fields (`targetSize`, `metricValue`) carry rounded values for KEDA
before 2.17; later versions read the float fields. `register` puts the same
readings (EPP defaults, every role) on the EPP's Prometheus registry as
`kvyard_epp_scaler_metric` and `kvyard_epp_scaler_active`, computed at scrape
time and present from the start.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from kvyard.common import keda
from kvyard.common.wire import ROLES

from ..flow.demand import Demand
from ..health import SERVER_OPTIONS, bind
from ..pool.endpoints import Endpoint, EndpointPool
from ..pool.metrics_parse import WorkerMetrics
from .capacity import Capacity, Fallback
from .meta import WAKES, MetadataError, ScaledObjectParams, ScalerDefaults, parse_metadata
from .metric import Reading, read
from .predictive import Forecast, from_capacity

log = logging.getLogger("kvyard.epp.scaler")
pb2, pb2_grpc = keda.pb2, keda.pb2_grpc


@dataclass(slots=True)
class ScalerConfig:
    defaults: ScalerDefaults = field(default_factory=ScalerDefaults)
    fallback: Fallback = field(default_factory=Fallback)
    stream_interval_s: float = 5.0  # StreamIsActive re-sends the current activity this often
    window_s: float = 1.0  # capacity measurement window per endpoint


@dataclass(slots=True, eq=False)
class _Stream:
    """One open StreamIsActive: woken by a notification or its period."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    notified: bool = False


class ScalerServicer(pb2_grpc.ExternalScalerServicer):
    def __init__(self, pool: EndpointPool, demand: Demand, pool_name: str, cfg: ScalerConfig,
                 capacity: Capacity) -> None:
        self.pool, self.demand, self.pool_name = pool, demand, pool_name
        self.cfg, self.capacity = cfg, capacity
        self.streams: dict[str, set[_Stream]] = {r: set() for r in ROLES}
        self.pushes = 0  # `true`s sent because of a notification
        self._unsubscribe = demand.subscribe(self._on_notify)
        # Set with the latency scorer: the arrival forecast per role (predictive.py).
        self.forecast: Callable[[str], Forecast] | None = None

    def close(self) -> None:
        self._unsubscribe()

    def _on_notify(self, wait_role: str) -> None:
        for role in WAKES.get(wait_role, ()):
            for s in self.streams[role]:
                s.notified = True
                s.wake.set()

    async def _params(self, ref: pb2.ScaledObjectRef, context) -> ScaledObjectParams:
        try:
            p = parse_metadata(dict(ref.scalerMetadata), self.cfg.defaults)
        except MetadataError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"ScaledObject {ref.namespace}/{ref.name}: {e}")
        if p.pool != self.pool_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"ScaledObject {ref.namespace}/{ref.name}: this EPP serves pool "
                                f"{self.pool_name!r}, not {p.pool!r} (scalerMetadata.pool)")
        return p

    def read(self, p: ScaledObjectParams) -> Reading:
        r = read(self.pool, self.demand, self.capacity, p)
        if self.forecast is not None and p.predictive:  # the SLO predictors' arrivals
            f = self.forecast(p.role)
            r.predicted = from_capacity(f, p.role, self.capacity.role(p.role),
                                        self.capacity.fallback, p.tpot_s, p.lead_s)
            r.metric = max(r.metric, r.predicted)
            r.active = r.active or f.rate > 0
        return r

    async def IsActive(self, request, context):
        p = await self._params(request, context)
        return pb2.IsActiveResponse(result=self.read(p).active)

    async def StreamIsActive(self, request, context):
        p = await self._params(request, context)
        s = _Stream()
        self.streams[p.role].add(s)
        try:
            yield pb2.IsActiveResponse(result=self.read(p).active)
            while True:
                try:
                    async with asyncio.timeout(self.cfg.stream_interval_s):
                        await s.wake.wait()
                except TimeoutError:
                    pass
                notified, s.notified = s.notified, False
                s.wake.clear()
                if notified:
                    self.pushes += 1
                    log.debug("wake %s/%s (%s): a request reached an empty role",
                              request.namespace, request.name, p.role)
                yield pb2.IsActiveResponse(result=notified or self.read(p).active)
        finally:
            self.streams[p.role].discard(s)

    async def GetMetricSpec(self, request, context):
        p = await self._params(request, context)
        return pb2.GetMetricSpecResponse(metricSpecs=[pb2.MetricSpec(
            metricName=p.metric_name, targetSize=max(1, round(p.target_value)),
            targetSizeFloat=p.target_value)])

    async def GetMetrics(self, request, context):
        ref = request.scaledObjectRef
        p = await self._params(ref, context)
        name = request.metricName or p.metric_name
        # KEDA strips its `sN-` prefix before asking; accept it either way.
        if re.sub(r"^s\d+-", "", name) != p.metric_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"ScaledObject {ref.namespace}/{ref.name}: no metric {name!r} "
                                f"(GetMetricSpec names {p.metric_name!r})")
        v = self.read(p).metric
        return pb2.GetMetricsResponse(metricValues=[pb2.MetricValue(
            metricName=name, metricValue=math.ceil(v), metricValueFloat=v)])


@dataclass(slots=True)
class ScalerServer:
    """The scaler's gRPC server on its own port. Wire `observe` to the scraper
    (capacity is measured from every good scrape)."""

    pool: EndpointPool
    demand: Demand
    pool_name: str
    cfg: ScalerConfig = field(default_factory=ScalerConfig)
    capacity: Capacity = field(init=False)
    servicer: ScalerServicer = field(init=False)
    host: str = ""
    port: int | None = None
    _server: grpc.aio.Server | None = None

    def __post_init__(self) -> None:
        self.capacity = Capacity(self.cfg.window_s, self.cfg.fallback)
        self.pool.on_remove(self.capacity.forget)
        self.servicer = ScalerServicer(self.pool, self.demand, self.pool_name, self.cfg,
                                       self.capacity)

    def observe(self, ep: Endpoint, m: WorkerMetrics, now: float | None = None) -> None:
        self.capacity.observe(ep, m, time.monotonic() if now is None else now)

    async def start(self, host: str, port: int,
                    credentials: grpc.ServerCredentials | None = None) -> int:
        """Binds (a taken port fails, as the EPP's other servers do) and serves, over TLS
        with `credentials`; returns the bound port (`port` 0: any free one)."""
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        pb2_grpc.add_ExternalScalerServicer_to_server(self.servicer, self._server)
        self.port = bind(self._server, host, port, "scaler", credentials)
        self.host = host
        await self._server.start()
        return self.port

    async def stop(self, grace: float = 0.5) -> None:
        self.servicer.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    def register(self, registry) -> None:
        """Export the readings on `registry` (a prometheus_client CollectorRegistry)."""
        registry.register(_ReadingsCollector(self))

    def snapshot(self) -> dict:
        """The scaler for /debug/endpoints: where it listens and what it measured."""
        d, fb = self.cfg.defaults, self.capacity.fallback
        return {"pool": self.pool_name, "port": self.port,
                "streams": {r: len(s) for r, s in self.servicer.streams.items()},
                "capacity": {r: self.capacity.role(r).snapshot(d.tpot_s, fb) for r in ROLES}}


class _ReadingsCollector:
    """What KEDA would read for each role with the EPP's default objectives."""

    def __init__(self, server: ScalerServer) -> None:
        self._server = server

    def describe(self) -> list:
        return []  # computed at collect time only

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        srv = self._server
        metric = GaugeMetricFamily("kvyard_epp_scaler_metric",
                                   "Replicas' worth of demand KEDA's GetMetrics reports",
                                   labels=["pool", "role"])
        active = GaugeMetricFamily("kvyard_epp_scaler_active", "KEDA's IsActive, 0 or 1",
                                   labels=["pool", "role"])
        d = srv.cfg.defaults
        for role in ROLES:
            p = ScaledObjectParams(srv.pool_name, role, d.target_value, d.ttft_s, d.tpot_s,
                                   d.kv_target)
            r = srv.servicer.read(p)
            metric.add_metric([srv.pool_name, role], r.metric)
            active.add_metric([srv.pool_name, role], float(r.active))
        yield metric
        yield active
