"""What the scaler tells KEDA about one role: is it active, and how many replicas'
worth of demand it has.

The metric is in replicas: with KEDA's default `AverageValue` target the HPA
computes `replicas = ceil(metric / targetValue)`, so `targetValue: 1` runs each
replica at its measured capacity and `0.8` keeps 20 % headroom. Inputs are the
role's endpoints (their scraped gauges plus the EPP's picks not yet visible in
them, `pending`), the requests flow control holds for the role (`Demand`), and
the per-replica capacity measured in `capacity.py`:

    held     = Demand.waiting(wait role)       parked (no ready endpoint) + queued
    queued   = Σ_endpoints (waiting + pending) + held
    prefill  = prompt_backlog / (prefill_tokens_per_s · ttft_objective)
               prompt_backlog: the endpoints' own `kvyard:prompt_tokens_pending`
               (admitted prompt tokens not computed yet) plus (held + our picks not
               yet scraped) x the measured prompt length; for an endpoint without
               that gauge (stock vLLM), its queue, plus its running requests on a
               prefill endpoint (mid-prefill), x the prompt length
    decode   = max((Σ running + queued) / sequences_at_tpot_objective,
                   Σ kv_usage / kv_target)

`prefill` is the number of replicas that clear the prompt backlog within the
TTFT objective; `decode` the number that run every sequence at the TPOT
objective, or hold the KV in use at the target occupancy, whichever is more.
A `prefill` ScaledObject reports `prefill`, a `decode` one `decode`, a `both`
one (colocated workers do both jobs) the larger of the two. Held requests are
in every term, so the metric is above zero while anything waits, even with no
pod at all, and it is 0 (present, not absent) for an idle pool.

Active: an endpoint of the role that is up has work (running, waiting or
pending), or requests are held for the role.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..flow.demand import Demand
from ..pool.endpoints import EndpointPool
from .capacity import Capacity
from .meta import ScaledObjectParams


@dataclass(slots=True)
class Reading:
    active: bool
    metric: float
    endpoints: int  # up endpoints of the role
    held: int
    prefill: float
    decode: float
    predicted: float = 0.0  # the arrival forecast's replicas (predictive.py); 0 without


def read(pool: EndpointPool, demand: Demand, cap: Capacity, p: ScaledObjectParams) -> Reading:
    eps = [e for e in pool.all() if e.role == p.role and not e.down and e.last_ok > 0.0]
    held = demand.waiting(p.wait_role)
    waiting = sum(e.waiting + e.pending for e in eps)
    running = sum(e.running for e in eps)
    queued = waiting + held
    rc = cap.role(p.role)
    fb = cap.fallback
    plen = rc.prompt_len(fb)
    tokens = held * plen  # what waits in the EPP, at the measured prompt length
    for e in eps:
        if e.prompt_tokens_pending is not None:  # a kvyard worker counts its own backlog
            tokens += e.prompt_tokens_pending + e.pending * plen
        else:                                     # stock vLLM: estimate it
            tokens += (e.waiting + e.pending + (e.running if p.role == "prefill" else 0.0)) * plen
    prefill = tokens / (rc.prefill_rate(fb) * p.ttft_s)
    decode = max((running + queued) / rc.decode_sequences(p.tpot_s, fb),
                 sum(e.kv_usage for e in eps) / p.kv_target)
    metric = {"prefill": prefill, "decode": decode}.get(p.role, max(prefill, decode))
    active = held > 0 or running + waiting > 0
    return Reading(active, metric, len(eps), held, prefill, decode)
