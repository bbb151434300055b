"""Small online models, dependency-free: recursive least squares and a quantile.

`Rls` is linear regression updated one sample at a time (Sherman-Morrison, O(d^2)
per sample, d ~ 7) with exponential forgetting, so a model follows an endpoint whose
behaviour drifts (after a rate step, within a few hundred requests). `Quantile` tracks
one quantile of a stream by stochastic approximation (no samples kept). The predictors
pair them: the mean from `Rls`, the p90 as the mean times the tracked p90 of
actual/predicted (in log space). `LatencyModel` fits relative error (each sample scaled
by 1/y: the least-squares fit of w.x/y to 1), which is what MAPE and an SLO's ratio
read; fitting absolute error lets the long waits past saturation pull the short ones'
predictions up (measured on `kvyard bench slo` traces: TTFT MAPE 0.49 -> 0.33).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class Rls:
    dim: int
    forget: float = 0.995  # memory of ~200 observations (below ~0.99 the update goes unstable)
    ridge: float = 100.0   # initial P = ridge * I: a weak prior at w = 0
    w: list[float] = field(default_factory=list)
    p: list[list[float]] = field(default_factory=list)
    n: int = 0

    def __post_init__(self) -> None:
        d = self.dim
        self.w = self.w or [0.0] * d
        self.p = self.p or [[self.ridge if i == j else 0.0 for j in range(d)] for i in range(d)]

    def predict(self, x: list[float]) -> float:
        return sum(a * b for a, b in zip(self.w, x))

    def update(self, x: list[float], y: float) -> None:
        p, lam = self.p, self.forget
        px = [sum(r[j] * x[j] for j in range(self.dim)) for r in p]
        denom = lam + sum(a * b for a, b in zip(x, px))
        if denom <= 1e-12:
            return
        k = [v / denom for v in px]
        err = y - self.predict(x)
        self.w = [w + ki * err for w, ki in zip(self.w, k)]
        inv = 1.0 / lam
        self.p = [[(p[i][j] - k[i] * px[j]) * inv for j in range(self.dim)]
                  for i in range(self.dim)]
        self.n += 1


@dataclass(slots=True)
class Quantile:
    """The q-quantile of a stream: each sample moves the estimate up by `step * q` if it
    is above, down by `step * (1 - q)` if below, which settles where P(x <= est) = q.
    The first samples take larger steps (1/sqrt(n)), so a new model's spread is found in
    tens of requests, not hundreds."""

    q: float = 0.9
    step: float = 0.05
    value: float = 0.0
    n: int = 0

    def update(self, x: float) -> None:
        self.n += 1
        step = max(self.step, 0.5 / math.sqrt(self.n))
        self.value += step * (self.q - (1.0 if x <= self.value else 0.0))


@dataclass(slots=True)
class LatencyModel:
    """Mean (RLS on the features) and p90 (mean x the tracked p90 of actual/mean)."""

    dim: int
    forget: float = 0.995
    relative: bool = True  # fit relative error (False: absolute, the mean; for comparison)
    floor: float = 1e-4   # a latency is never predicted below this (seconds)
    rls: Rls = field(init=False)
    ratio: Quantile = field(default_factory=Quantile)

    def __post_init__(self) -> None:
        self.rls = Rls(self.dim, self.forget)

    @property
    def samples(self) -> int:
        return self.rls.n

    def predict(self, x: list[float]) -> tuple[float, float]:
        mean = max(self.floor, self.rls.predict(x))
        return mean, mean * math.exp(self.ratio.value)

    def update(self, x: list[float], y: float) -> None:
        y = max(y, self.floor)
        mean = max(self.floor, self.rls.predict(x))
        self.ratio.update(math.log(y / mean))
        if self.relative:
            self.rls.update([v / y for v in x], 1.0)
        else:
            self.rls.update(x, y)
