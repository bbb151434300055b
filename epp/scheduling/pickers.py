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


def _tied(totals: list[float]) -> list[int]:
    best = max(totals)
    return [i for i, t in enumerate(totals) if best - t <= 1e-9]


def _with_fallbacks(first: int, totals: list[float], n: int) -> list[int]:
    """`first`, then up to n - 1 others, best total first."""
    if n == 1:
        return [first]
    rest = sorted((i for i in range(len(totals)) if i != first), key=lambda i: -totals[i])
    return [first, *rest[: n - 1]]


@dataclass(slots=True)
class MaxScorePicker(Picker):
    """The highest total score, random among ties; then the rest best first."""

    max_endpoints: int = 1
    name: str = "max-score"

    @classmethod
    def build(cls, p: MaxScoreParams) -> "MaxScorePicker":
        return cls(p.maxEndpoints)

    def pick(self, totals: list[float], rng: random.Random) -> list[int]:
        tied = _tied(totals)
        first = tied[0] if len(tied) == 1 else rng.choice(tied)
        return _with_fallbacks(first, totals, self.max_endpoints)


@dataclass(slots=True)
class RoundRobinPicker(Picker):
    """The highest total score, taking ties in turn (one step per pick); then the rest best
    first. With no scorers every endpoint ties, so the candidates are served in turn.

    The turn counts picks, not endpoints: candidates arrive in the pool's order (by address
    with EPP replicas), so a stable pool is visited in a fixed cycle, and a pool that
    changes size keeps rotating from where it was."""

    max_endpoints: int = 1
    name: str = "round-robin"
    _turn: int = 0

    @classmethod
    def build(cls, p: MaxScoreParams) -> "RoundRobinPicker":
        return cls(p.maxEndpoints)

    def pick(self, totals: list[float], rng: random.Random) -> list[int]:
        tied = _tied(totals)
        first = tied[self._turn % len(tied)]
        self._turn += 1
        return _with_fallbacks(first, totals, self.max_endpoints)
