"""Wires a scheduler's latency scorer into the EPP: request facts at parse time, SLO
admission, the ext_proc response observer, the scaler's forecast and the metrics."""
from __future__ import annotations

from typing import Mapping

from ..scaler.predictive import Forecast
from ..scheduling.scheduler import Scheduler
from ..scheduling.scorers.latency import LatencyScorer
from ..scheduling.types import SchedRequest
from .headers import FACTS, RequestFacts, fairness_id, parse_slo
from .predictor import RATE_WINDOW_S, LatencyPredictor


def latency_scorers(sched: Scheduler) -> list[LatencyScorer]:
    """The config's latency scorers; every profile's share the first one's predictor."""
    found = [s for prof in sched.profiles.values() for s, _ in prof.scorers
             if isinstance(s, LatencyScorer)]
    for s in found[1:]:
        s.predictor = found[0].predictor
    return found


def annotator(predictor: LatencyPredictor):
    """`Director.on_parse`: the request's SLO (a bad header is a 400) and facts."""

    def on_parse(req: SchedRequest, headers: Mapping[str, str], parsed) -> None:
        facts = RequestFacts(parse_slo(headers),
                             req.prompt.estimated_blocks() * req.prompt.block_size,
                             getattr(parsed, "max_tokens", None), fairness_id(headers),
                             req.model)
        predictor.annotate(facts)
        req.cycle.write(FACTS, facts)

    return on_parse


def forecaster(predictor: LatencyPredictor):
    """The scaler's per-role forecast from the arrivals the predictor counted."""

    def forecast(role: str) -> Forecast:
        return Forecast(*predictor.forecast(role), age_s=RATE_WINDOW_S / 2)

    return forecast
