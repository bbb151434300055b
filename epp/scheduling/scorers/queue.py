"""The queue scorer: shorter queues score higher."""
from __future__ import annotations

from dataclasses import dataclass

from ...pool.endpoints import Endpoint
from ..hooks import Scorer
from ..types import SchedRequest

# A spread of queues smaller than this many requests scores as a fraction of it: without
# a floor a one-request difference swung the full weight, outweighing a long cached
# prefix, so groups sharing a prefix were spread over the pool long before any pod was
# saturated. Larger spreads score as before.
MIN_SPREAD = 8.0


@dataclass(slots=True)
class QueueScorer(Scorer):
    """1 − (q − minQ)/max(maxQ − minQ, 8); q includes our own picks since the last
    scrape, so a burst between two scrapes spreads instead of piling up."""

    name: str = "queue"
    min_spread: float = MIN_SPREAD

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        qs = [e.waiting + e.pending for e in eps]
        lo, hi = min(qs), max(qs)
        if hi == lo:
            return [1.0] * len(qs)
        span = max(hi - lo, self.min_spread)
        return [1.0 - (q - lo) / span for q in qs]
