"""A scrape that timed out is not a dead endpoint.

Under load a pod's `/metrics` answer can take longer than the scrape timeout while the
pod serves fine: counting those timeouts as failures marked busy pods down exactly when
the pool needed them (the `healthy` filter then left the load to fewer pods, which timed
out in turn). So the scraper tells the failures apart:

* refused or unreachable: the process is gone, down at once (`scraper.py`);
* reset connections, HTTP errors, answers that are not vLLM's metrics: down after
  `fail_threshold` in a row (`scraper.py`);
* timed out, on an endpoint that answered before: *stale*. It stays routable with its
  last metrics (and the picks made since, `Endpoint.pending`, which the queue scorer
  counts) until `grace` seconds have passed since its last good scrape, then it is down.
  The `healthy` filter keeps it, and so does `prefer-fresh` (it drops endpoints whose
  metrics are merely old, e.g. failing with HTTP errors, not these): a prefix's pod that
  answers its scrapes late keeps its prefix's requests, and the EPP's readiness
  (`EndpointPool.ready`) holds while its pods are only late (`Endpoint.current`);
* timed out on an endpoint never scraped: there is nothing to route by, so the
  `fail_threshold` rule applies, as it does with `grace` 0.

`kvyard_epp_scrape_timeouts_total{outcome}` counts them: `stale` (tolerated) and `down`
(the grace ran out).
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from .endpoints import Endpoint

STALE, DOWN, COUNT = "stale", "down", "count"


@dataclass(slots=True)
class TimeoutGrace:
    grace: float = 5.0  # seconds since the last good scrape; 0: timeouts are failures
    stale: int = 0      # timed-out scrapes tolerated
    expired: int = 0    # endpoints marked down when their grace ran out

    def on_timeout(self, ep: Endpoint, now: float) -> str:
        """STALE: keep `ep` routable; DOWN: mark it down now; COUNT: an ordinary failure."""
        if self.grace <= 0 or ep.last_ok <= 0.0:
            return COUNT
        if now - ep.last_ok <= self.grace:
            self.stale += 1
            return STALE
        if not ep.down:
            self.expired += 1
        return DOWN

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(_Collector(self))


@dataclass(slots=True, eq=False)  # hashable: the registry keys collectors
class _Collector:
    grace: TimeoutGrace

    def collect(self):
        c = CounterMetricFamily("kvyard_epp_scrape_timeouts",
                                "Timed-out /metrics scrapes: stale (endpoint kept routable on "
                                "its last metrics) or down (its grace ran out)",
                                labels=["outcome"])
        c.add_metric([STALE], self.grace.stale)
        c.add_metric([DOWN], self.grace.expired)
        yield c
