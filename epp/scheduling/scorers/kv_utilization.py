"""The KV-cache utilization scorer: emptier caches score higher."""
from __future__ import annotations

from dataclasses import dataclass

from ...pool.endpoints import Endpoint
from ..hooks import Scorer
from ..types import SchedRequest


@dataclass(slots=True)
class KvUtilizationScorer(Scorer):
    """1 - kv_usage (the scraped fraction of the endpoint's KV cache in use)."""

    name: str = "kv-cache-utilization"

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        return [1.0 - e.kv_usage for e in eps]
