"""Flow control's Prometheus series, present with value 0 from the start.

llm-d's queue series appear on the first request and vanish when idle, and
KEDA reads an absent series as 0, so a pool at zero could fail to wake
(protocols.md §3). Here every (priority, stage) the config knows of and every
outcome exists from start-up, labelled with the pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STAGES = ("waiting_room", "saturated")
OUTCOMES = ("dispatched", "expired", "shed", "queue_full", "cancelled", "shutdown")
_WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                 600.0)


@dataclass(slots=True)
class FlowMetrics:
    registry: CollectorRegistry
    pool: str = "default"
    priorities: Iterable[int] = (0,)
    size: Gauge = field(init=False)
    bytes: Gauge = field(init=False)
    wait: Histogram = field(init=False)
    requests: Counter = field(init=False)

    def __post_init__(self) -> None:
        r, lab = self.registry, ["pool", "priority", "stage"]
        self.size = Gauge("kvyard_epp_flow_queue_size",
                          "Requests the EPP holds (waiting_room: no ready endpoint; "
                          "saturated: the pool is saturated)", lab, registry=r)
        self.bytes = Gauge("kvyard_epp_flow_queue_bytes", "Request bytes the EPP holds", lab,
                           registry=r)
        self.wait = Histogram("kvyard_epp_flow_wait_seconds",
                              "Time a request was held, by where it waited",
                              ["pool", "stage"], buckets=_WAIT_BUCKETS, registry=r)
        self.requests = Counter("kvyard_epp_flow_requests",
                                "Requests leaving flow control, by outcome",
                                ["pool", "outcome"], registry=r)
        for p in sorted(set(self.priorities) | {0}):
            for st in STAGES:
                self.size.labels(self.pool, str(p), st)
                self.bytes.labels(self.pool, str(p), st)
        for st in STAGES:
            self.wait.labels(self.pool, st)
        for o in OUTCOMES:
            self.requests.labels(self.pool, o)

    def held(self, priority: int, stage: str, dn: int, dbytes: int) -> None:
        self.size.labels(self.pool, str(priority), stage).inc(dn)
        self.bytes.labels(self.pool, str(priority), stage).inc(dbytes)

    def outcome(self, name: str) -> None:
        self.requests.labels(self.pool, name).inc()

    def waited(self, stage: str, seconds: float) -> None:
        self.wait.labels(self.pool, stage).observe(seconds)
