"""The predictive scaling signal: replicas the arrival rate will need, before a violation.

The reactive metric (`metric.py`) sees demand once it is queued or running; by then a
GPU pod that takes minutes to start is late. This one reads the arrivals the EPP
routed in the last 15 s (their rate, its trend, and the per-request cost the
predictors see: prompt tokens and predicted output tokens, `epp/slo/predictor.py`)
and the per-replica capacity `capacity.py` measured, and reports the replicas needed
at the rate expected `lead_s` from now (the pod start time):

    rate'    = max(rate, rate + trend * (lead_s + age_s))
               rate: the mean over the window, which is centred `age_s` back (half the
               window); lead_s: the scalerMetadata's `leadMs`, the pod start time. Only a
               rising trend is extrapolated: a pod stops at once, so the lead buys
               nothing on the way down, and a noisy falling trend over a minute's lead
               would forecast no traffic under a steady load
    prefill  = rate' * prompt_tokens / prefill_tokens_per_s            (busy replicas)
    decode   = rate' * output_tokens * tpot_objective / sequences_at_tpot_objective
               (Little's law: sequences in flight, each lasting output x TPOT)
    replicas = prefill (role prefill), decode (role decode), max(prefill, decode) (both)

For `both` the larger term, as in the reactive metric: a colocated pod's decode capacity
is measured on steps that also carry prefill chunks (`capacity.py`'s TPOT samples), so it
already pays for the prefill; adding the prefill term would count that time twice.

The scaler reports the larger of this and the reactive metric, so a backlog still
scales the pool when the forecast is low.
"""
from __future__ import annotations

from dataclasses import dataclass

from .capacity import Fallback, RoleCapacity

LEAD_S = 60.0


@dataclass(slots=True, frozen=True)
class Forecast:
    rate: float            # arrivals per second
    trend: float           # its change per second
    prompt_tokens: float   # mean per request
    output_tokens: float   # mean predicted per request
    age_s: float = 0.0     # how long ago `rate` held: half its averaging window


def required_replicas(f: Forecast, role: str, prefill_tokens_per_s: float,
                      sequences_at_tpot: float, tpot_s: float, lead_s: float = LEAD_S) -> float:
    rate = max(f.rate, f.rate + f.trend * (lead_s + f.age_s))
    prefill = rate * f.prompt_tokens / max(prefill_tokens_per_s, 1e-9)
    decode = rate * f.output_tokens * tpot_s / max(sequences_at_tpot, 1e-9)
    return {"prefill": prefill, "decode": decode}.get(role, max(prefill, decode))


def from_capacity(f: Forecast, role: str, rc: RoleCapacity, fb: Fallback, tpot_s: float,
                  lead_s: float = LEAD_S) -> float:
    """`required_replicas` with the capacity the scaler measured for the role."""
    return required_replicas(f, role, rc.prefill_rate(fb), rc.decode_sequences(tpot_s, fb),
                             tpot_s, lead_s)
