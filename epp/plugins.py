"""Filters and scorers: small, stateless where possible, each one idea.

A filter narrows the candidate list; a scorer returns one value in [0, 1]
per candidate (higher is better) and is weighted by the scheduler. Plugins
are looked up by the names used in the YAML config (`FILTERS`, `SCORERS`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .endpoints import Endpoint
from .prefix_index import PrefixIndex
from .prompt import LazyPrompt


@dataclass(slots=True)
class SchedRequest:
    model: str
    prompt: LazyPrompt  # chained block hashes of the prompt, computed on demand
    priority: int = 0
    now: float = 0.0  # monotonic time of the decision
    stale_after: float = 2.0
    matched: dict[str, int] = field(default_factory=dict)  # address -> matched blocks


class Filter(Protocol):
    name: str

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]: ...


class Scorer(Protocol):
    name: str

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]: ...

    def on_pick(self, req: SchedRequest, ep: Endpoint) -> None: ...


@dataclass(slots=True)
class HealthyFilter:
    """Endpoints whose scrapes keep failing (or were refused) get no traffic."""

    name: str = "healthy"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        return [e for e in eps if not e.down]


@dataclass(slots=True)
class PreferFreshFilter:
    """Stale metrics (older than `stale_after`) lose to fresh ones, but a pool
    that is entirely stale still serves: a slow scrape is not an outage."""

    name: str = "prefer-fresh"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        fresh = [e for e in eps if e.fresh(req.now, req.stale_after)]
        return fresh or eps


@dataclass(slots=True)
class DecodeRoleFilter:
    """The destination is a decode (or both) pod; prefill-only pods are for
    the future P/D profile. A pool with none of those still serves."""

    name: str = "role"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        out = [e for e in eps if e.role != "prefill"]
        return out or eps


@dataclass(slots=True)
class QueueScorer:
    """(maxQ − q)/(maxQ − minQ); q includes our own picks since the last
    scrape, so a burst between two scrapes spreads instead of piling up."""

    name: str = "queue"

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        qs = [e.waiting + e.pending for e in eps]
        lo, hi = min(qs), max(qs)
        if hi == lo:
            return [1.0] * len(qs)
        span = hi - lo
        return [(hi - q) / span for q in qs]

    def on_pick(self, req: SchedRequest, ep: Endpoint) -> None:
        pass


@dataclass(slots=True)
class KvUtilizationScorer:
    name: str = "kv-cache-utilization"

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        return [1.0 - e.kv_usage for e in eps]

    def on_pick(self, req: SchedRequest, ep: Endpoint) -> None:
        pass


@dataclass(slots=True)
class PrefixCacheScorer:
    """Matched leading blocks / total blocks; learns from each pick."""

    index: PrefixIndex
    name: str = "prefix-cache"

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        matched = [self.index.match(e.address, req.prompt) for e in eps]
        total = max(req.prompt.estimated_blocks(), max(matched))
        if total == 0:
            return [0.0] * len(eps)
        for e, n in zip(eps, matched):
            req.matched[e.address] = n
        return [n / total for n in matched]

    def on_pick(self, req: SchedRequest, ep: Endpoint) -> None:
        # What is hashed so far; the rest arrives via Scheduler.learn after the answer.
        if req.prompt.hashes:
            self.index.record(ep.address, req.prompt.hashes)


FILTERS: dict[str, Callable[[dict[str, Any]], Filter]] = {
    "healthy": lambda p: HealthyFilter(),
    "prefer-fresh": lambda p: PreferFreshFilter(),
    "role": lambda p: DecodeRoleFilter(),
}


def _prefix(p: dict[str, Any]) -> PrefixCacheScorer:
    return PrefixCacheScorer(PrefixIndex(int(p.get("lruCapacityPerServer", 31_250))))


SCORERS: dict[str, Callable[[dict[str, Any]], Scorer]] = {
    "queue": lambda p: QueueScorer(),
    "kv-cache-utilization": lambda p: KvUtilizationScorer(),
    "prefix-cache": _prefix,
}
