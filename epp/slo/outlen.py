"""Output-length prediction ("anticipated generation length") from what the EPP sees.

A request's output is predicted from the history of its fairness id (a tenant or
agent tends to ask for similar answers), then its model's, as an exponentially
weighted mean of observed output tokens, capped by its `max_tokens`; with no history,
`max_tokens` itself (the baseline), or `default_tokens` without one. Errors are kept
for the prediction and for the max_tokens-only baseline on the same requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_HISTORY = 3


@dataclass(slots=True)
class _Ewma:
    mean: float = 0.0
    n: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.n += 1
        self.mean = x if self.n == 1 else self.mean + alpha * (x - self.mean)


@dataclass(slots=True)
class OutputLength:
    alpha: float = 0.2
    default_tokens: int = 512
    max_keys: int = 10_000  # fairness ids remembered (oldest forgotten first)
    by_key: dict[tuple[str, str], _Ewma] = field(default_factory=dict)
    by_model: dict[str, _Ewma] = field(default_factory=dict)
    abs_err: float = 0.0
    abs_err_baseline: float = 0.0
    n: int = 0

    def baseline(self, max_tokens: int | None) -> float:
        return float(max_tokens if max_tokens else self.default_tokens)

    def predict(self, model: str, fairness: str, max_tokens: int | None) -> float:
        cap = self.baseline(max_tokens)
        h = self.by_key.get((model, fairness)) if fairness else None
        if h is None or h.n < MIN_HISTORY:
            h = self.by_model.get(model)
        if h is None or h.n < MIN_HISTORY:
            return cap
        return min(cap, max(1.0, h.mean))

    def observe(self, model: str, fairness: str, max_tokens: int | None, predicted: float,
                actual: int) -> None:
        self.abs_err += abs(predicted - actual)
        self.abs_err_baseline += abs(self.baseline(max_tokens) - actual)
        self.n += 1
        if fairness:
            key = (model, fairness)
            h = self.by_key.pop(key, None) or _Ewma()
            self.by_key[key] = h  # re-inserted: most recent last
            h.add(actual, self.alpha)
            if len(self.by_key) > self.max_keys:
                del self.by_key[next(iter(self.by_key))]
        self.by_model.setdefault(model, _Ewma()).add(actual, self.alpha)

    def errors(self) -> dict:
        n = max(1, self.n)
        return {"samples": self.n, "mae": self.abs_err / n if self.n else None,
                "mae_baseline": self.abs_err_baseline / n if self.n else None}
