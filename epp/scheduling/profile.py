"""A scheduling profile: filters → weighted scorers → picker over the pool (GAIE's shape).

Its result is an ordered list of endpoints (the pick first, then fallbacks).
Every score is clamped to [0, 1] before it is weighted, as the reference EPP
does, so a scorer that strays cannot outweigh the others; NaN counts as 0.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..pool.endpoints import Endpoint
from .hooks import Filter, Picker, Scorer
from .pickers import MaxScorePicker
from .types import ProfileResult, SchedRequest


@dataclass(slots=True)
class SchedulingProfile:
    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker = field(default_factory=MaxScorePicker)

    def plugins(self) -> list[object]:
        return [*self.filters, *(s for s, _ in self.scorers), self.picker]

    def candidates(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        for f in self.filters:
            if not eps:
                break
            eps = f.filter(req, eps)
        return eps

    def run(self, req: SchedRequest, eps: list[Endpoint],
            rng: random.Random) -> ProfileResult | None:
        eps = self.candidates(req, eps)
        if not eps:
            return None
        totals = [0.0] * len(eps)
        for scorer, weight in self.scorers:
            totals = [t + weight * (s if 0.0 <= s <= 1.0 else 1.0 if s > 1.0 else 0.0)
                      for t, s in zip(totals, scorer.score(req, eps), strict=True)]
        order = self.picker.pick(totals, rng)
        return ProfileResult([eps[i] for i in order], totals[order[0]], len(eps))
