"""The queue scorer: shorter queues score higher."""
from __future__ import annotations

from dataclasses import dataclass

from ...pool.endpoints import Endpoint
from ..hooks import Scorer
from ..types import SchedRequest


@dataclass(slots=True)
class QueueScorer(Scorer):
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
