"""The SLO headers (llm-d-router's names) and the request facts the SLO plugins share.

`x-llm-d-slo-ttft-ms` and `x-llm-d-slo-tpot-ms` are the request's objectives in
milliseconds (positive numbers; a bad value is a 400 naming the header). The
objective/priority comes from `x-llm-d-inference-objective` or its alias
`x-gateway-inference-objective` (`request.priority_of`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from kvyard.common.wire import FAIRNESS_HEADER

from ..request import Rejection
from ..scheduling.cycle import StateKey

SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
SLO_TPOT_HEADER = "x-llm-d-slo-tpot-ms"


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ((self.ttft_s is None or ttft_s <= self.ttft_s)
                and (self.tpot_s is None or math.isnan(tpot_s) or tpot_s <= self.tpot_s))


@dataclass(slots=True)
class RequestFacts:
    """What the predictors read about a request, written once at parse time."""

    slo: Slo | None
    prompt_tokens: int           # estimated from the prompt's blocks until hashed
    max_tokens: int | None
    fairness_id: str
    model: str
    predicted_output: float = 0.0  # the output-length model's guess, set by the predictor


FACTS: StateKey[RequestFacts] = StateKey("slo/request-facts")


def _ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise Rejection(400, f"header {name} must be a positive number of milliseconds, "
                             f"got {raw[:40]!r}", "invalid_slo_header", param=name)
    return v / 1000.0


def parse_slo(headers: Mapping[str, str]) -> Slo | None:
    """The request's SLO, None without SLO headers; raises Rejection on a bad value."""
    ttft, tpot = _ms(headers, SLO_TTFT_HEADER), _ms(headers, SLO_TPOT_HEADER)
    return None if ttft is None and tpot is None else Slo(ttft, tpot)


def fairness_id(headers: Mapping[str, str]) -> str:
    return headers.get(FAIRNESS_HEADER, "")
