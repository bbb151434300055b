"""TTFT and TPOT predictors, trained online from the EPP's own observations.

TTFT and TPOT each have `models.py`'s `PoolModels` (`LatencyModel`s: mean by
relative-error recursive least squares on `features.py`'s vectors, p90 from the tracked
spread): a model per role, pooled over its endpoints (a new pod is predicted like its
peers from its first request), and one per endpoint that takes over where it predicts
that endpoint better. A request the latency scorer routes becomes a `Flight`: the prediction made
for it before any of its own outcome was known (so the errors below are on held-out
requests), the features it was made from, and its share of the endpoint's load
(prefill tokens until its first token, predicted output tokens while it decodes).
The ext_proc server reports the first token and the end (`observe.py`); the models
learn from them, and the errors (MAPE, p90 coverage), the output-length errors, SLO
attainment and TTFT violations are kept for `/debug` and Prometheus.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..pool.endpoints import Endpoint
from ..prompt import LazyPrompt
from ..scheduling.cycle import PREFIX_MATCHES, StateKey
from ..scheduling.types import SchedRequest
from .features import TPOT_DIM, TTFT_DIM, EndpointLoad, tpot_features, ttft_features
from .headers import FACTS, RequestFacts, Slo
from .models import PoolModels
from .outlen import OutputLength

MAX_FLIGHTS = 8192        # routed requests waiting for their stream (the oldest dropped)
ATTAINMENT_WINDOW = 512   # recent SLO requests per class behind kvyard:slo_attainment
RATE_WINDOW_S = 15.0      # arrivals counted for the scaler's rate (its trend shows a ramp ~half of this in)
# RLS memory, in outcomes: TTFT follows the queue (~200), TPOT's noisier samples need ~1000
TTFT_FORGET = 0.995
TPOT_FORGET = 0.999


@dataclass(slots=True)
class Prediction:
    ttft: float
    ttft_p90: float
    tpot: float
    tpot_p90: float


# Predictions per endpoint address for the request (the latency scorer writes it).
PREDICTIONS: StateKey[dict[str, Prediction]] = StateKey("latency/predictions")


@dataclass(slots=True)
class ErrorStats:
    """Absolute percentage error of the mean and how often the p90 covered the outcome."""

    ape: float = 0.0
    covered: int = 0
    n: int = 0

    def add(self, mean: float, p90: float, actual: float) -> None:
        if actual <= 0:
            return
        self.ape += abs(mean - actual) / actual
        self.covered += actual <= p90
        self.n += 1

    def snapshot(self) -> dict:
        return {"samples": self.n, "mape": self.ape / self.n if self.n else None,
                "p90_coverage": self.covered / self.n if self.n else None}


@dataclass(slots=True)
class TypicalSlo:
    """The standard (priority >= 0) class's typical request: exponentially weighted means
    of the TTFT and TPOT objectives its requests carry and of their uncached prompt
    tokens on the endpoint they were routed to."""

    alpha: float = 0.02
    ttft_s: float | None = None
    tpot_s: float | None = None
    uncached: float = 0.0

    def add(self, slo: Slo, uncached: float) -> None:
        self.ttft_s = _ewma(self.ttft_s, slo.ttft_s, self.alpha)
        self.tpot_s = _ewma(self.tpot_s, slo.tpot_s, self.alpha)
        self.uncached = _ewma(self.uncached, uncached, self.alpha) or 0.0

    def objective(self) -> Slo | None:
        return None if self.ttft_s is None and self.tpot_s is None else Slo(self.ttft_s,
                                                                            self.tpot_s)


def _ewma(mean: float | None, x: float | None, alpha: float) -> float | None:
    if x is None:
        return mean
    return x if mean is None else mean + alpha * (x - mean)


@dataclass(slots=True)
class Flight:
    address: str
    role: str
    facts: RequestFacts
    uncached: float
    x_ttft: list[float]
    x_tpot: list[float]
    pred: Prediction
    priority: int
    t0: float
    first: float | None = None
    decode_tokens: float = 0.0  # what this flight adds to its endpoint's decode_tokens
    closed: bool = False
    raw: dict | None = None     # the state it was routed in, kept only while tracing


def slo_class(priority: int) -> str:
    return "sheddable" if priority < 0 else "standard"


@dataclass(slots=True)
class LatencyPredictor:
    min_samples: int = 20
    observe_fraction: float = 1.0
    rng: random.Random = field(default_factory=random.Random)
    ttft_models: PoolModels = field(default_factory=lambda: PoolModels(TTFT_DIM, TTFT_FORGET))
    tpot_models: PoolModels = field(default_factory=lambda: PoolModels(TPOT_DIM, TPOT_FORGET))
    loads: dict[str, EndpointLoad] = field(default_factory=dict)
    flights: dict[int, Flight] = field(default_factory=dict)  # id(prompt) -> routed flight
    outlen: OutputLength = field(default_factory=OutputLength)
    ttft_err: ErrorStats = field(default_factory=ErrorStats)
    tpot_err: ErrorStats = field(default_factory=ErrorStats)
    recent: dict[str, deque] = field(default_factory=dict)  # class -> recent SLO met (bool)
    slo_requests: dict[str, int] = field(default_factory=dict)
    ttft_violations: dict[str, int] = field(default_factory=dict)
    arrivals: dict[str, deque] = field(default_factory=dict)  # role -> (t, prompt, output)
    standard: TypicalSlo = field(default_factory=TypicalSlo)
    trace: Callable[[dict], None] | None = None  # one record per followed request (offline fits)

    # ---- models -------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.ttft_models.min_samples = self.tpot_models.min_samples = self.min_samples

    def confident(self, ep: Endpoint) -> bool:
        """Whether the models predicting for `ep` have learned enough to act on."""
        return (self.ttft_models.model(ep.address, ep.role).samples >= self.min_samples
                and self.tpot_models.model(ep.address, ep.role).samples >= self.min_samples)

    def load(self, address: str) -> EndpointLoad:
        ld = self.loads.get(address)
        if ld is None:
            ld = self.loads[address] = EndpointLoad()
        return ld

    # ---- prediction ---------------------------------------------------------------
    def uncached(self, req: SchedRequest, facts: RequestFacts, ep: Endpoint) -> float:
        matched = req.cycle.read(PREFIX_MATCHES, {}).get(ep.address, 0)
        return max(0.0, facts.prompt_tokens - matched * req.prompt.block_size)

    def predict_one(self, req: SchedRequest, facts: RequestFacts, ep: Endpoint) -> Prediction:
        ld = self.load(ep.address)
        ttft, ttft90 = self.ttft_models.model(ep.address, ep.role).predict(
            ttft_features(ep, ld, self.uncached(req, facts, ep), req.now))
        tpot, tpot90 = self.tpot_models.model(ep.address, ep.role).predict(
            tpot_features(ep, ld, req.now, facts.predicted_output))
        return Prediction(ttft, ttft90, tpot, tpot90)

    def predict(self, req: SchedRequest, eps: list[Endpoint]) -> list[Prediction]:
        facts = req.cycle.read(FACTS)
        if facts is None:
            return []
        preds = [self.predict_one(req, facts, e) for e in eps]
        req.cycle.write(PREDICTIONS, {e.address: p for e, p in zip(eps, preds)})
        return preds

    def standard_late(self, req: SchedRequest, eps: list[Endpoint],
                      preds: list[Prediction]) -> bool:
        """Whether a typical standard request arriving now is predicted (p90) to miss its
        objective on every endpoint: the pool's queues, not this request's own prompt."""
        std = self.standard.objective()
        if std is None:
            return False
        for e, p in zip(eps, preds):
            x = ttft_features(e, self.load(e.address), self.standard.uncached, req.now)
            if std.met(self.ttft_models.model(e.address, e.role).predict(x)[1], p.tpot_p90):
                return False
        return True

    def annotate(self, facts: RequestFacts) -> None:
        facts.predicted_output = self.outlen.predict(facts.model, facts.fairness_id,
                                                     facts.max_tokens)

    # ---- flights ------------------------------------------------------------------
    def start(self, req: SchedRequest, ep: Endpoint) -> Flight | None:
        """The request was routed to `ep`: count its arrival, and follow it when sampled."""
        facts = req.cycle.read(FACTS)
        if facts is None:
            return None
        now = time.monotonic()
        self._arrival(ep.role, now, facts)
        ld = self.load(ep.address)
        unc = self.uncached(req, facts, ep)
        if facts.slo is not None and req.priority >= 0:
            self.standard.add(facts.slo, unc)
        if self.observe_fraction < 1.0 and self.rng.random() >= self.observe_fraction:
            ld.routed(unc, now)
            return None
        pred = req.cycle.read(PREDICTIONS, {}).get(ep.address) or self.predict_one(req, facts, ep)
        f = Flight(ep.address, ep.role, facts, unc, ttft_features(ep, ld, unc, now),
                   tpot_features(ep, ld, now, facts.predicted_output), pred, req.priority, now)
        if self.trace is not None:
            f.raw = _raw_state(ep, ld, now, facts)
        ld.prefill_tokens += unc
        ld.prefilling += 1
        ld.routed(unc, now)
        if len(self.flights) >= MAX_FLIGHTS:  # never claimed (no ext_proc stream)
            self.abandon(self.flights.pop(next(iter(self.flights))))
        self.flights[id(req.prompt)] = f
        return f

    def claim(self, prompt: LazyPrompt | None) -> Flight | None:
        """The ext_proc stream that answers this decision takes its flight."""
        return None if prompt is None else self.flights.pop(id(prompt), None)

    def first_token(self, f: Flight, t: float) -> None:
        if f.first is not None or f.closed:
            return
        f.first = t
        ld = self.load(f.address)
        ld.prefill_tokens = max(0.0, ld.prefill_tokens - f.uncached)
        ld.prefilling = max(0, ld.prefilling - 1)
        ld.decoding += 1
        f.decode_tokens = f.facts.predicted_output
        ld.decode_tokens += f.decode_tokens
        ttft = t - f.t0
        self.ttft_models.learn(f.address, f.role, f.x_ttft, ttft)
        self.ttft_err.add(f.pred.ttft, f.pred.ttft_p90, ttft)

    def finish(self, f: Flight, t: float, events: int, tokens: int | None) -> None:
        """The response ended: `events` generated-text events seen, `tokens` from usage."""
        if f.closed:
            return
        if f.first is None:
            if events == 0:  # an error answer or a body the EPP could not read
                self.abandon(f)
                return
            self.first_token(f, t)
        # usage counts tokens; an event may carry several (a server that batches writes)
        out = tokens if tokens is not None else events
        tpot = (t - f.first) / (out - 1) if out > 1 and events > 1 else math.nan
        if not math.isnan(tpot):
            self.tpot_models.learn(f.address, f.role, f.x_tpot, tpot)
            self.tpot_err.add(f.pred.tpot, f.pred.tpot_p90, tpot)
        fa = f.facts
        if out > 0:
            self.outlen.observe(fa.model, fa.fairness_id, fa.max_tokens, fa.predicted_output, out)
        if fa.slo is not None:
            cls = slo_class(f.priority)
            ttft = f.first - f.t0
            met = fa.slo.met(ttft, tpot)
            self.recent.setdefault(cls, deque(maxlen=ATTAINMENT_WINDOW)).append(met)
            self.slo_requests[cls] = self.slo_requests.get(cls, 0) + 1
            if fa.slo.ttft_s is not None and ttft > fa.slo.ttft_s:
                self.ttft_violations[cls] = self.ttft_violations.get(cls, 0) + 1
        self._close(f, tpot, out)

    def abandon(self, f: Flight) -> None:
        """No outcome will come (stream reset, error answer): release its load only."""
        if not f.closed:
            if f.first is None:
                ld = self.load(f.address)
                ld.prefill_tokens = max(0.0, ld.prefill_tokens - f.uncached)
                ld.prefilling = max(0, ld.prefilling - 1)
            self._close(f)

    def _close(self, f: Flight, tpot: float = math.nan, out: int = 0) -> None:
        f.closed = True
        if self.trace is not None and f.raw is not None:
            self.trace({**f.raw, "ttft": None if f.first is None else f.first - f.t0,
                        "tpot": None if math.isnan(tpot) else tpot, "out": out,
                        "uncached": f.uncached, "pred": [f.pred.ttft, f.pred.ttft_p90,
                                                         f.pred.tpot, f.pred.tpot_p90]})
        if f.first is not None:
            ld = self.load(f.address)
            ld.decoding = max(0, ld.decoding - 1)
            ld.decode_tokens = max(0.0, ld.decode_tokens - f.decode_tokens)

    def forget(self, address: str) -> None:
        self.loads.pop(address, None)
        self.ttft_models.forget_endpoint(address)
        self.tpot_models.forget_endpoint(address)

    # ---- what the scaler and metrics read -----------------------------------------
    def _arrival(self, role: str, now: float, facts: RequestFacts) -> None:
        q = self.arrivals.setdefault(role, deque())
        q.append((now, facts.prompt_tokens, facts.predicted_output))
        while q and q[0][0] < now - RATE_WINDOW_S:
            q.popleft()

    def forecast(self, role: str, now: float | None = None) -> tuple[float, float, float, float]:
        """(arrival rate /s, its trend /s^2, mean prompt tokens, mean predicted output
        tokens) of the requests routed to `role` in the last RATE_WINDOW_S."""
        now = time.monotonic() if now is None else now
        q = self.arrivals.get(role)
        while q and q[0][0] < now - RATE_WINDOW_S:
            q.popleft()
        if not q:
            return 0.0, 0.0, 0.0, 0.0
        half = RATE_WINDOW_S / 2
        recent = sum(1 for t, _, _ in q if t >= now - half)
        older = len(q) - recent
        rate = len(q) / RATE_WINDOW_S
        trend = (recent - older) / half / half
        return (rate, trend, sum(p for _, p, _ in q) / len(q), sum(o for _, _, o in q) / len(q))

    def attainment(self) -> dict[str, float]:
        return {c: sum(d) / len(d) for c, d in self.recent.items() if d}

    def snapshot(self) -> dict:
        return {"ttft": self.ttft_err.snapshot(), "tpot": self.tpot_err.snapshot(),
                "output_len": self.outlen.errors(), "attainment": self.attainment(),
                "slo_requests": dict(self.slo_requests),
                "ttft_violations": dict(self.ttft_violations),
                "in_flight": len(self.flights),
                "models": {**{f"ttft:{k}": n for k, n in self.ttft_models.samples().items()},
                           **{f"tpot:{k}": n for k, n in self.tpot_models.samples().items()}}}


def _raw_state(ep: Endpoint, ld: EndpointLoad, now: float, facts: RequestFacts) -> dict:
    return {"address": ep.address, "t0": now, "waiting": ep.waiting, "pending": ep.pending,
            "running": ep.running, "kv": ep.kv_usage, "ptp": ep.prompt_tokens_pending,
            "age": now - ep.last_ok if ep.last_ok else None,
            "l_prefill": ld.prefill_tokens, "l_prefilling": ld.prefilling,
            "l_decoding": ld.decoding, "l_decode_tokens": ld.decode_tokens,
            "l_rate": ld.rate(now), "prompt": facts.prompt_tokens,
            "max_tokens": facts.max_tokens, "pred_out": facts.predicted_output}
