"""One latency quantity's models over a pool: a model per role, pooled over the role's
endpoints, and one per endpoint, used for an endpoint only while it predicts that
endpoint's outcomes better than the pooled one.

Pooling is the better default: an endpoint sees 1/N of the role's outcomes, and on a
pool of alike pods the pooled fit was clearly better on held-out requests (`kvyard
bench slo` traces, TTFT MAPE 0.49 per endpoint vs 0.33 pooled). A pod that differs (a
slower GPU, a noisy neighbour) is what an endpoint's own model is for: each outcome is
predicted by both before either learns it, and the endpoint's own model takes over when
its recent absolute percentage error is clearly lower.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .online import LatencyModel

ERR_ALPHA = 0.05  # EWMA of each model's percentage error on an endpoint (~20 outcomes)
MARGIN = 0.8      # the own model takes over when clearly better (their errors are noisy)


@dataclass(slots=True)
class _Own:
    model: LatencyModel
    err_own: float = 0.0
    err_pooled: float = 0.0


@dataclass(slots=True)
class PoolModels:
    dim: int
    forget: float = 0.995
    min_samples: int = 20
    relative: bool = True
    pooled: dict[str, LatencyModel] = field(default_factory=dict)  # role -> model
    own: dict[str, _Own] = field(default_factory=dict)             # address -> model

    def pooled_model(self, role: str) -> LatencyModel:
        m = self.pooled.get(role)
        if m is None:
            m = self.pooled[role] = LatencyModel(self.dim, self.forget, self.relative)
        return m

    def model(self, address: str, role: str) -> LatencyModel:
        o = self.own.get(address)
        if (o is not None and o.model.samples >= self.min_samples
                and o.err_own < MARGIN * o.err_pooled):
            return o.model
        return self.pooled_model(role)

    def learn(self, address: str, role: str, x: list[float], y: float) -> None:
        pooled = self.pooled_model(role)
        o = self.own.get(address)
        if o is None:
            o = self.own[address] = _Own(LatencyModel(self.dim, self.forget, self.relative))
        if y > 0:
            o.err_own += ERR_ALPHA * (abs(o.model.predict(x)[0] - y) / y - o.err_own)
            o.err_pooled += ERR_ALPHA * (abs(pooled.predict(x)[0] - y) / y - o.err_pooled)
        o.model.update(x, y)
        pooled.update(x, y)

    def forget_endpoint(self, address: str) -> None:
        self.own.pop(address, None)

    def samples(self) -> dict[str, int]:
        out = {f"role:{r}": m.samples for r, m in self.pooled.items()}
        out.update({a: o.model.samples for a, o in self.own.items()})
        return out
