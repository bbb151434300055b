"""`kvyard bench slo`'s autoscaling comparison: reactive vs predictive scaling on one
simulated traffic ramp, same run, same pod model.

What it models (a fluid simulation, one-second steps, deterministic): a pool of at most
`max_pods` pods, each serving `capacity` requests/s within the SLO (from the pod's
prefill rate, the mean prompt, the mean output and the sequences it runs at the TPOT
objective, the numbers the EPP's scaler measures); a pod takes `start_s` to become
ready (a GPU pod's minutes, or the spare's second); requests beyond the ready pods'
capacity queue, and a second's arrivals meet the TTFT objective when the queue ahead of
them drains within it. Traffic: `base` req/s for 60 s, a ramp to 2x over 120 s, 60 s at
2x, a 30 s spike to 2.5x, then back to 2x (300 s).
- reactive: the scaler's backlog signal (`epp/scaler/metric.py`'s shape): replicas =
  served load / capacity + queue / (capacity x TTFT objective), every 15 s (KEDA's
  polling), scale-down after 60 s below.
- predictive: the same, or the EPP's forecast when larger
  (`epp/scaler/predictive.required_replicas`: the arrival rate of the last 30 s and its
  trend, extrapolated by the pod start time), from the same inputs.
Reported: SLO attainment (share of requests meeting TTFT), goodput and pod-seconds.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvyard.epp.scaler.predictive import Forecast, required_replicas

from .slo_autoscale_traffic import Ramp


@dataclass(slots=True, frozen=True)
class PodModel:
    prefill_tokens_per_s: float = 4000.0
    sequences_at_tpot: float = 16.0
    tpot_s: float = 0.025
    prompt_tokens: float = 1000.0
    output_tokens: float = 120.0

    @property
    def capacity(self) -> float:
        """Requests/s one pod serves: prefill time plus its share of decode slots."""
        return 1.0 / (self.prompt_tokens / self.prefill_tokens_per_s
                      + self.output_tokens * self.tpot_s / self.sequences_at_tpot)


TARGET = 0.9  # KEDA's targetValue for both: replicas = ceil(metric / 0.9)


def fluid_ramp(base: float) -> Ramp:
    """The fluid model's traffic: the stack's ramp shape, 120 s of ramp, 30 s after the spike,
    no warm-up."""
    return Ramp(base_rps=base, base_s=60.0, ramp_s=120.0, hold_s=60.0, spike_s=30.0, after_s=30.0, warmup_s=0.0)


def simulate(predictive: bool, pod: PodModel, base: float, max_pods: int, start_s: float,
             ttft_s: float = 0.5, duration_s: int = 300, poll_s: int = 15,
             cooldown_s: int = 60) -> dict:
    cap = pod.capacity
    ready = max(1, math.ceil(base / cap))
    starting: deque[float] = deque()  # ready times of pods starting
    queue = served_total = met = arrived = pod_s = 0.0
    window: deque[tuple[int, float]] = deque()
    low_since: int | None = None
    ramp = fluid_ramp(base)
    for t in range(duration_s):
        while starting and starting[0] <= t:
            starting.popleft()
            ready += 1
        rate = ramp.rate(t)
        window.append((t, rate))
        while window[0][0] <= t - 30:
            window.popleft()
        service = ready * cap
        wait = queue / service if service else math.inf
        met += rate if wait <= ttft_s else 0.0
        arrived += rate
        served = min(queue + rate, service)
        queue = queue + rate - served
        served_total += served
        pod_s += ready + len(starting)
        if t % poll_s:
            continue
        want = served / cap + queue / (cap * ttft_s)
        if predictive:
            half = [r for s, r in window if s > t - 15]
            older = [r for s, r in window if s <= t - 15]
            mean = sum(r for _, r in window) / len(window)
            trend = ((sum(half) / len(half) - sum(older) / len(older)) / 15.0
                     if half and older else 0.0)
            f = Forecast(mean, trend, pod.prompt_tokens, pod.output_tokens, age_s=15.0)
            # this model's pods split their time additively (`PodModel.capacity`), and its
            # decode capacity is pure decode: both terms, summed
            want = max(want, sum(required_replicas(f, role, pod.prefill_tokens_per_s,
                                                   pod.sequences_at_tpot, pod.tpot_s, start_s)
                                 for role in ("prefill", "decode")))
        desired = min(max_pods, max(1, math.ceil(want / TARGET)))
        have = ready + len(starting)
        if desired > have:
            low_since = None
            starting.extend([t + start_s] * (desired - have))
        elif desired < ready:
            low_since = t if low_since is None else low_since
            if t - low_since >= cooldown_s:
                ready = desired
                low_since = None
        else:
            low_since = None
    return {"attainment": met / arrived if arrived else math.nan,
            "goodput": met / duration_s, "pod_seconds": pod_s}


def compare(base: float, max_pods: int = 16, start_s: float = 30.0,
            pod: PodModel | None = None, spare_s: float = 1.0) -> dict:
    """Both policies with pods that start in `start_s`, and (under "spare") in `spare_s`."""
    pod = pod or PodModel()
    return {"reactive": simulate(False, pod, base, max_pods, start_s),
            "predictive": simulate(True, pod, base, max_pods, start_s),
            "spare": {k: simulate(k == "predictive", pod, base, max_pods, spare_s)
                      for k in ("reactive", "predictive")},
            "model": {"pod_capacity_rps": pod.capacity, "base_rps": base, "max_pods": max_pods,
                      "pod_start_s": start_s, "spare_start_s": spare_s}}
