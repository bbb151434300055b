"""Per-endpoint TTFT and TPOT predictors, trained online from the EPP's own observations.

Each endpoint has a TTFT and a TPOT `LatencyModel` (mean by recursive least squares on
`features.py`'s vectors, p90 from the tracked spread); until an endpoint's own model
has `min_samples` observations its role's pooled model (trained on every endpoint of
the role) predicts for it, so a new pod is predicted like its peers from its first
request. A request the latency scorer routes becomes a `Flight`: the prediction made
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

from ..pool.endpoints import Endpoint
from ..prompt import LazyPrompt
from ..scheduling.cycle import PREFIX_MATCHES, StateKey
from ..scheduling.types import SchedRequest
from .features import TPOT_DIM, TTFT_DIM, EndpointLoad, tpot_features, ttft_features
from .headers import FACTS, RequestFacts
from .online import LatencyModel
from .outlen import OutputLength

MAX_FLIGHTS = 8192        # routed requests waiting for their stream (the oldest dropped)
ATTAINMENT_WINDOW = 512   # recent SLO requests per class behind kvyard:slo_attainment
RATE_WINDOW_S = 30.0      # arrivals counted for the scaler's rate


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


def slo_class(priority: int) -> str:
    return "sheddable" if priority < 0 else "standard"


@dataclass(slots=True)
class LatencyPredictor:
    min_samples: int = 20
    observe_fraction: float = 1.0
    rng: random.Random = field(default_factory=random.Random)
    models: dict[tuple[str, str], LatencyModel] = field(default_factory=dict)
    loads: dict[str, EndpointLoad] = field(default_factory=dict)
    flights: dict[int, Flight] = field(default_factory=dict)  # id(prompt) -> routed flight
    outlen: OutputLength = field(default_factory=OutputLength)
    ttft_err: ErrorStats = field(default_factory=ErrorStats)
    tpot_err: ErrorStats = field(default_factory=ErrorStats)
    recent: dict[str, deque] = field(default_factory=dict)  # class -> recent SLO met (bool)
    slo_requests: dict[str, int] = field(default_factory=dict)
    ttft_violations: dict[str, int] = field(default_factory=dict)
    arrivals: dict[str, deque] = field(default_factory=dict)  # role -> (t, prompt, output)

    # ---- models -------------------------------------------------------------------
    def _pair(self, kind: str, key: str) -> LatencyModel:
        m = self.models.get((kind, key))
        if m is None:
            m = self.models[(kind, key)] = LatencyModel(TTFT_DIM if kind == "ttft" else TPOT_DIM)
        return m

    def _model(self, kind: str, ep: Endpoint) -> LatencyModel:
        own = self.models.get((kind, ep.address))
        if own is not None and own.samples >= self.min_samples:
            return own
        return self._pair(kind, "role:" + ep.role)

    def confident(self, ep: Endpoint) -> bool:
        """Whether the models predicting for `ep` have learned enough to act on."""
        return (self._model("ttft", ep).samples >= self.min_samples
                and self._model("tpot", ep).samples >= self.min_samples)

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
        ttft, ttft90 = self._model("ttft", ep).predict(
            ttft_features(ep, ld, self.uncached(req, facts, ep)))
        tpot, tpot90 = self._model("tpot", ep).predict(tpot_features(ep, ld, req.now))
        return Prediction(ttft, ttft90, tpot, tpot90)

    def predict(self, req: SchedRequest, eps: list[Endpoint]) -> list[Prediction]:
        facts = req.cycle.read(FACTS)
        if facts is None:
            return []
        preds = [self.predict_one(req, facts, e) for e in eps]
        req.cycle.write(PREDICTIONS, {e.address: p for e, p in zip(eps, preds)})
        return preds

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
        if self.observe_fraction < 1.0 and self.rng.random() >= self.observe_fraction:
            ld.routed(unc, now)
            return None
        pred = req.cycle.read(PREDICTIONS, {}).get(ep.address) or self.predict_one(req, facts, ep)
        f = Flight(ep.address, ep.role, facts, unc, ttft_features(ep, ld, unc),
                   tpot_features(ep, ld, now), pred, req.priority, now)
        ld.prefill_tokens += unc
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
        ld.decoding += 1
        f.decode_tokens = f.facts.predicted_output
        ld.decode_tokens += f.decode_tokens
        ttft = t - f.t0
        self._pair("ttft", f.address).update(f.x_ttft, ttft)
        self._pair("ttft", "role:" + f.role).update(f.x_ttft, ttft)
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
            self._pair("tpot", f.address).update(f.x_tpot, tpot)
            self._pair("tpot", "role:" + f.role).update(f.x_tpot, tpot)
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
        self._close(f)

    def abandon(self, f: Flight) -> None:
        """No outcome will come (stream reset, error answer): release its load only."""
        if not f.closed:
            if f.first is None:
                ld = self.load(f.address)
                ld.prefill_tokens = max(0.0, ld.prefill_tokens - f.uncached)
            self._close(f)

    def _close(self, f: Flight) -> None:
        f.closed = True
        if f.first is not None:
            ld = self.load(f.address)
            ld.decoding = max(0, ld.decoding - 1)
            ld.decode_tokens = max(0.0, ld.decode_tokens - f.decode_tokens)

    def forget(self, address: str) -> None:
        self.loads.pop(address, None)
        for kind in ("ttft", "tpot"):
            self.models.pop((kind, address), None)

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
                "models": {f"{k}:{a}": m.samples for (k, a), m in self.models.items()}}
