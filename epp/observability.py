"""The EPP's own Prometheus metrics and the /debug/endpoints view.

Each EPP instance owns a CollectorRegistry (tests and benchmarks can run
several in one process without clashing). The HTTP side is a small aiohttp
app on the metrics port; `kvyard status` reads /debug/endpoints.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .pool.endpoints import EndpointPool
from .scheduling.types import Decision

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


@dataclass(slots=True)
class EppMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    latency: Histogram = field(init=False)
    picks: Counter = field(init=False)
    prefix_ratio: Histogram = field(init=False)
    prefix_blocks: Counter = field(init=False)
    prefix_matched: Counter = field(init=False)
    errors: Counter = field(init=False)
    endpoints: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.latency = Histogram("kvyard_epp_decision_seconds",
                                 "Time to parse, hash, score and pick for one request",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.picks = Counter("kvyard_epp_picks", "Requests routed, per endpoint",
                             ["endpoint"], registry=r)
        self.prefix_ratio = Histogram("kvyard_epp_prefix_hit_ratio",
                                      "Matched/total prompt blocks on the picked endpoint",
                                      buckets=_RATIO_BUCKETS, registry=r)
        self.prefix_blocks = Counter("kvyard_epp_prefix_blocks", "Prompt blocks routed",
                                     registry=r)
        self.prefix_matched = Counter("kvyard_epp_prefix_matched_blocks",
                                      "Prompt blocks already on the picked endpoint", registry=r)
        self.errors = Counter("kvyard_epp_errors", "Requests answered by the EPP itself",
                              ["reason"], registry=r)
        self.endpoints = Gauge("kvyard_epp_endpoints", "Endpoints known", ["state"], registry=r)

    def decision(self, seconds: float, d: Decision) -> None:
        self.latency.observe(seconds)
        self.picks.labels(d.endpoint.address).inc()
        if d.total_blocks:
            self.prefix_ratio.observe(d.matched_blocks / d.total_blocks)
            self.prefix_blocks.inc(d.total_blocks)
            self.prefix_matched.inc(d.matched_blocks)

    def forget(self, address: str) -> None:
        """An endpoint left the pool: drop its series rather than keep them forever."""
        try:
            self.picks.remove(address)
        except KeyError:
            pass

    def error(self, reason: str) -> None:
        self.errors.labels(reason).inc()

    def update_pool(self, pool: EndpointPool) -> None:
        now = time.monotonic()
        eps = pool.all()
        self.endpoints.labels("known").set(len(eps))
        self.endpoints.labels("ready").set(
            sum(1 for e in eps if not e.down and e.fresh(now, pool.stale_after)))
        self.endpoints.labels("scrape_stale").set(sum(1 for e in eps if e.timeouts and not e.down))


def debug_app(metrics: EppMetrics, pool: EndpointPool, extra: Callable[[], dict]) -> web.Application:
    async def prom(_: web.Request) -> web.Response:
        metrics.update_pool(pool)
        return web.Response(body=generate_latest(metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def endpoints(_: web.Request) -> web.Response:
        now = time.monotonic()
        eps = sorted(pool.all(), key=lambda e: e.address)
        return web.json_response({"endpoints": [e.snapshot(now, pool.stale_after) for e in eps],
                                  "ready": pool.ready(now), **extra()})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", prom)
    app.router.add_get("/debug/endpoints", endpoints)
    app.router.add_get("/healthz", healthz)
    return app
