"""Filters: each narrows the candidate list by one rule."""
from __future__ import annotations

from dataclasses import dataclass

from ..pool.endpoints import Endpoint
from .hooks import Filter
from .types import SchedRequest


@dataclass(slots=True)
class HealthyFilter(Filter):
    """Endpoints whose scrapes keep failing (or were refused), and sleeping ones
    (kvyard:sleeping 1, sleep mode), get no traffic. One whose scrapes only time out
    keeps it, on its last metrics, for the scraper's grace (`pool/staleness.py`)."""

    name: str = "healthy"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        return [e for e in eps if not e.down and not e.sleeping]


@dataclass(slots=True)
class PreferFreshFilter(Filter):
    """Stale metrics (older than `stale_after`) lose to fresh ones, but a pool
    that is entirely stale still serves: a slow scrape is not an outage. An endpoint
    whose scrapes only time out (in the scraper's grace, `pool/staleness.py`) is a busy
    pod, not an unknown one: it competes on its last metrics and the picks sent since."""

    name: str = "prefer-fresh"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        fresh = [e for e in eps if e.current(req.now, req.stale_after)]
        return fresh or eps


@dataclass(slots=True)
class DecodeRoleFilter(Filter):
    """The destination is a decode (or both) pod; prefill-only pods are for
    the P/D profile. A pool with none of those still serves."""

    name: str = "role"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        out = [e for e in eps if e.role != "prefill"]
        return out or eps


@dataclass(slots=True)
class PrefillRoleFilter(Filter):
    """Prefill candidates: prefill pods, or `both` pods when there are none."""

    name: str = "prefill-role"

    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        return [e for e in eps if e.role == "prefill"] or [e for e in eps if e.role == "both"]
