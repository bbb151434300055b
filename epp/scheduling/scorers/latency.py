"""The latency scorer: endpoints predicted to meet the request's TTFT and TPOT objectives.

For a request with SLO headers (`epp/slo/headers.py`), each candidate's p90 TTFT and
TPOT are predicted (`epp/slo/predictor.py`, which this plugin owns and teaches). The
slack of an endpoint is `ttftWeight * (slo_ttft - p90_ttft) / slo_ttft + tpotWeight *
(slo_tpot - p90_tpot) / slo_tpot`. Endpoints that meet both score in [0.8, 1] (with
`headroom: least`, the default as in llm-d, less slack scores higher: work is packed
where it just fits and lightly loaded endpoints keep room; `most`, more slack first);
the band is narrow so that among feasible endpoints the prefix and load scorers still
decide (a cache hit saves the pool work). Those that miss score in [0, 0.2], the least
late highest. With SLO admission on (`epp/slo/admission.py`) a sheddable request is
refused with 429 `rejected-slo-unattainable` when none meets its SLO, and also, with
`protectStandard`, when on none a typical standard (priority >= 0) request (its typical
objective and uncached prompt: the pool's queues decide, not this prompt's size) is
predicted (p90) to meet its objective. The pool is then at the limit where more work
makes the standard class late, and the sheddable request yields before queues build:
the sheddable class's own objective is usually the looser one, so shedding only when
that is out of reach comes after the standard class has collapsed.

Cache affinity: an endpoint holding `moveTokens` fewer of the prompt's tokens than the
best-matched candidate scores in the late band whatever its prediction. Moving a request
off its cached endpoint makes the pool recompute the prefix, and that prefill lands in the
decode steps of every request running on the new endpoint: a cost to them that the
request's own prediction does not see. Past saturation, scoring such moves by the mover's
predicted latency spread work to the edge of every endpoint's objective and lowered both
goodput and attainment; so the latency scorer only ranks endpoints that hold about as much
of the prompt as the best one (all of them for a cold prompt), and leaving a cached
endpoint stays the prefix and load scorers' call ("sticky until saturated").

A request without SLO headers scores 0 everywhere, so it routes exactly as without
this scorer; so does every request until the predictor has `minSamples` observations.
As a `PreRequest` hook the plugin starts following each routed request (the ext_proc
server then asks Envoy for the response phases, `observe.py`), as a `PoolListener` it
forgets a departed endpoint's models.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ...pool.endpoints import Endpoint
from ...request import slo_unattainable
from ...slo.headers import FACTS
from ...slo.predictor import LatencyPredictor, Prediction
from ...slo.trace import jsonl_writer
from ..cycle import PREFIX_MATCHES, StateKey
from ..hooks import PoolListener, PreRequest, Scorer
from ..plugin_config import param
from ..types import SchedRequest

# Set by SLO admission on the requests it admits: shed when nothing meets the SLO.
SHED_UNATTAINABLE: StateKey[bool] = StateKey("latency/shed-unattainable")
# Whether any candidate was predicted to meet the request's SLO.
SLO_MEETS: StateKey[bool] = StateKey("latency/meets")


@dataclass(slots=True, frozen=True)
class LatencyParams:
    ttftWeight: float = param(0.8, min=0.0, doc="weight of TTFT slack")
    tpotWeight: float = param(0.2, min=0.0, doc="weight of TPOT slack")
    headroom: str = param("least", choices=("least", "most"),
                          doc="among endpoints that meet the SLO, prefer the least or most slack")
    moveTokens: int = param(256, min=0, doc="an endpoint holding this many fewer prompt tokens "
                                            "than the best-matched one is scored as late")
    minSamples: int = param(20, min=1, doc="observations before predictions are acted on")
    observeFraction: float = param(1.0, min=0.0, max=1.0,
                                   doc="share of routed requests whose responses are timed")
    traceFile: str = param("", doc="append one JSON line per followed request (the state it "
                                   "was routed in, its prediction and outcome) to this file")
    admission: bool = param(False, doc="SLO admission: shed sheddable requests no endpoint "
                                       "is predicted to meet (429)")
    protectStandard: bool = param(True, doc="with admission: also shed sheddable requests "
                                            "when no endpoint is predicted to meet the "
                                            "standard class's typical objective")


def _clamp(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


@dataclass(slots=True)
class LatencyScorer(Scorer, PreRequest, PoolListener):
    predictor: LatencyPredictor
    params: LatencyParams
    name: str = "latency"

    @classmethod
    def build(cls, p: LatencyParams) -> "LatencyScorer":
        pred = LatencyPredictor(p.minSamples, p.observeFraction, random.Random(0))
        if p.traceFile:
            pred.trace = jsonl_writer(p.traceFile)
        return cls(pred, p)

    def slack(self, slo, pr: Prediction) -> float:
        p = self.params
        s = 0.0
        if slo.ttft_s is not None:
            s += p.ttftWeight * (slo.ttft_s - pr.ttft_p90) / slo.ttft_s
        if slo.tpot_s is not None:
            s += p.tpotWeight * (slo.tpot_s - pr.tpot_p90) / slo.tpot_s
        return s

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        facts = req.cycle.read(FACTS)
        if facts is None or facts.slo is None or not eps:
            return [0.0] * len(eps)
        pred = self.predictor
        if not all(pred.confident(e) for e in eps):
            return [0.0] * len(eps)
        slo = facts.slo
        preds = pred.predict(req, eps)
        meets = [slo.met(p.ttft_p90, p.tpot_p90) for p in preds]
        req.cycle.write(SLO_MEETS, any(meets))
        if req.priority < 0 and req.cycle.read(SHED_UNATTAINABLE):
            if not any(meets) or (self.params.protectStandard and
                                  pred.standard_late(req, eps, preds)):
                raise slo_unattainable()
        least = self.params.headroom == "least"
        matched = req.cycle.read(PREFIX_MATCHES, {})
        bs = req.prompt.block_size if req.prompt is not None else 0
        held = [matched.get(e.address, 0) * bs for e in eps]
        floor = max(held) - self.params.moveTokens
        out = []
        for m, p, h in zip(meets, preds, held):
            s = self.slack(slo, p)
            if m and h >= floor:  # a narrow band: among feasible endpoints prefix and load still decide
                out.append(0.8 + 0.2 * (1.0 - _clamp(s) if least else _clamp(s)))
            else:  # late: s < 0; the least late scores highest, in a narrow band too:
                # steering every late request to the least loaded endpoint moves
                # conversations off their cached endpoints, which adds prefill work
                # to a pool already past saturation
                out.append(0.2 * _clamp(1.0 + s))
        return out

    def pre_request(self, req: SchedRequest, ep: Endpoint) -> None:
        self.predictor.start(req, ep)

    def forget(self, address: str) -> None:
        self.predictor.forget(address)
