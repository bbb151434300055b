"""Pickers: the endpoint(s) a profile returns, from the weighted score totals."""
from __future__ import annotations

import random
from dataclasses import dataclass

from .hooks import Picker
from .plugin_config import param


@dataclass(slots=True, frozen=True)
class MaxScoreParams:
    maxEndpoints: int = param(1, min=1, max=16,
                              doc="endpoints returned: the pick, then fallbacks by score")


@dataclass(slots=True)
class MaxScorePicker(Picker):
    """The highest total score, random among ties; then the rest best first."""

    max_endpoints: int = 1
    name: str = "max-score"

    @classmethod
    def build(cls, p: MaxScoreParams) -> "MaxScorePicker":
        return cls(p.maxEndpoints)

    def pick(self, totals: list[float], rng: random.Random) -> list[int]:
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if best - t <= 1e-9]
        first = tied[0] if len(tied) == 1 else rng.choice(tied)
        if self.max_endpoints == 1:
            return [first]
        rest = sorted((i for i in range(len(totals)) if i != first), key=lambda i: -totals[i])
        return [first, *rest[: self.max_endpoints - 1]]
