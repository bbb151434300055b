"""Filters and scorers: small, stateless where possible, each one idea.

A filter narrows the candidate list; a scorer returns one value in [0, 1]
per candidate (higher is better) and is weighted by its profile. Both get the
request, whose `cycle` (`cycle.CycleState`) is the state plugins share for
this request: what one plugin computes (the prefix scorer's matches) is
written there for the others. Optional hooks, found by name, not by type:
`pre_request(req, ep)` once an endpoint is picked, `learn(address,
hashes)` once the whole prompt is hashed after the answer, `forget(address)`
when an endpoint leaves the pool.

Plugins are looked up by the names the YAML config uses (`REGISTRY`), each
with a parameters dataclass validated at load (`plugin_config`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..pool.endpoints import Endpoint
from ..prompt import LazyPrompt
from .cycle import PREFIX_MATCHES, CycleState
from .plugin_config import NoParams, param
from .prefix_index import PrefixIndex


@dataclass(slots=True)
class SchedRequest:
    model: str
    prompt: LazyPrompt  # chained block hashes of the prompt, computed on demand
    priority: int = 0
    now: float = 0.0  # monotonic time of the decision
    stale_after: float = 2.0
    cycle: CycleState = field(default_factory=CycleState)  # this request's shared plugin state


class Filter(Protocol):
    name: str

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]: ...


class Scorer(Protocol):
    name: str

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]: ...


@dataclass(slots=True)
class HealthyFilter:
    """Endpoints whose scrapes keep failing (or were refused), and sleeping ones
    (kvyard:sleeping 1, sleep mode), get no traffic."""

    name: str = "healthy"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        return [e for e in eps if not e.down and not e.sleeping]


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
    the P/D profile. A pool with none of those still serves."""

    name: str = "role"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        out = [e for e in eps if e.role != "prefill"]
        return out or eps


@dataclass(slots=True)
class PrefillRoleFilter:
    """Prefill candidates: prefill pods, or `both` pods when there are none."""

    name: str = "prefill-role"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        return [e for e in eps if e.role == "prefill"] or [e for e in eps if e.role == "both"]


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


@dataclass(slots=True)
class KvUtilizationScorer:
    name: str = "kv-cache-utilization"

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        return [1.0 - e.kv_usage for e in eps]


@dataclass(slots=True)
class PrefixCacheScorer:
    """Matched leading blocks / total blocks; learns from each pick. Writes the
    matches per endpoint to the cycle state (`PREFIX_MATCHES`)."""

    index: PrefixIndex
    name: str = "prefix-cache"

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        matched = [self.index.match(e.address, req.prompt) for e in eps]
        total = max(req.prompt.estimated_blocks(), max(matched))
        if total == 0:
            return [0.0] * len(eps)
        seen = req.cycle.read(PREFIX_MATCHES)
        if seen is None:
            req.cycle.write(PREFIX_MATCHES, seen := {})
        seen.update((e.address, n) for e, n in zip(eps, matched))
        return [n / total for n in matched]

    def pre_request(self, req: SchedRequest, ep: Endpoint) -> None:
        # What is hashed so far; the rest arrives via `learn` after the answer.
        if req.prompt.hashes:
            self.index.record(ep.address, req.prompt.hashes)

    def learn(self, address: str, hashes: list[int]) -> None:
        if hashes:
            self.index.record(address, hashes)

    def forget(self, address: str) -> None:
        self.index.remove(address)


@dataclass(slots=True, frozen=True)
class PrefixCacheParams:
    lruCapacityPerServer: int = param(31_250, min=1,
                                      doc="block hashes remembered per endpoint (LRU)")


@dataclass(slots=True, frozen=True)
class PluginType:
    """A plugin as the config names it: its parameters and how to build it."""

    factory: Callable[[Any], Any]
    params: type = NoParams
    doc: str = ""


FILTERS: dict[str, PluginType] = {
    "healthy": PluginType(lambda p: HealthyFilter(), doc=HealthyFilter.__doc__ or ""),
    "prefer-fresh": PluginType(lambda p: PreferFreshFilter(), doc=PreferFreshFilter.__doc__ or ""),
    "role": PluginType(lambda p: DecodeRoleFilter(), doc=DecodeRoleFilter.__doc__ or ""),
    "prefill-role": PluginType(lambda p: PrefillRoleFilter(), doc=PrefillRoleFilter.__doc__ or ""),
}
SCORERS: dict[str, PluginType] = {
    "queue": PluginType(lambda p: QueueScorer(), doc=QueueScorer.__doc__ or ""),
    "kv-cache-utilization": PluginType(lambda p: KvUtilizationScorer(), doc="1 - kv_usage"),
    "prefix-cache": PluginType(lambda p: PrefixCacheScorer(PrefixIndex(p.lruCapacityPerServer)),
                               PrefixCacheParams, PrefixCacheScorer.__doc__ or ""),
}
