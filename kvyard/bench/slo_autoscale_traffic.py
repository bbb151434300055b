"""The autoscaling comparison's traffic ramp and what a run's samples add up to
(`slo_autoscale_stack`). Simulated seconds throughout."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Ramp:
    """After `warmup_s` at `base_rps` (not measured: the EPP's rate window and capacity
    estimates fill), `base_rps` for `base_s`, a linear ramp to 2x over `ramp_s`, `hold_s`
    at 2x, a spike to `spike_x` for `spike_s`, then `after_s` at 2x."""

    base_rps: float = 2.0
    base_s: float = 60.0
    ramp_s: float = 60.0
    hold_s: float = 60.0
    spike_x: float = 2.5
    spike_s: float = 30.0
    after_s: float = 60.0
    warmup_s: float = 120.0

    @property
    def duration(self) -> float:
        """The measured part."""
        return self.base_s + self.ramp_s + self.hold_s + self.spike_s + self.after_s

    @property
    def end(self) -> float:
        return self.warmup_s + self.duration

    def phases(self) -> list[tuple[str, float, float]]:
        """(name, start, end) of each phase, the warm-up first."""
        out, t = [], 0.0
        for name, d in (("warmup", self.warmup_s), ("base", self.base_s),
                        ("ramp", self.ramp_s), ("hold", self.hold_s),
                        ("spike", self.spike_s), ("after", self.after_s)):
            out.append((name, t, t + d))
            t += d
        return out

    def rate(self, t: float) -> float:
        b = self.base_rps
        for name, lo, hi in self.phases():
            if t < hi:
                return {"base": b, "ramp": b * (1.0 + (t - lo) / max(hi - lo, 1e-9)),
                        "spike": b * self.spike_x}.get(name, 2.0 * b)
        return 2.0 * b

    def arrivals(self, rng: random.Random) -> list[float]:
        """A Poisson process of rate `rate(t)` (thinning a process at the peak rate)."""
        peak = self.base_rps * max(2.0, self.spike_x)
        out, t = [], 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= self.end:
                return out
            if rng.random() * peak < self.rate(t):
                out.append(t)


QUICK_RAMP = Ramp(base_s=20.0, ramp_s=20.0, hold_s=10.0, spike_s=10.0, after_s=10.0,
                  warmup_s=90.0)


@dataclass(slots=True)
class Sample:
    t: float                  # wall seconds since the traffic began
    started: list[str]        # pods started and not stopped (the state's endpoints)
    ready: list[str]          # pods the EPP scrapes
    replicas: int | None      # the autoscaler's wish
    metric: float | None
    backlog: float | None


def _pct(xs: list[float], q: float) -> float:
    from kvyard.bench.report import percentile

    return percentile(xs, q) if xs else math.nan


def pod_seconds(samples: list[Sample], start_wall: float, end_wall: float,
                scale: float) -> float:
    """Pods started and not yet stopped, integrated over [start_wall, end_wall], in
    simulated seconds."""
    total = 0.0
    for a, b in zip(samples, samples[1:]):
        lo, hi = max(a.t, start_wall), min(b.t, end_wall)
        if hi > lo:
            total += len(a.started) * (hi - lo)
    return total * scale


def start_latency(samples: list[Sample], scale: float) -> float:
    """Mean simulated seconds from a pod's start (in the state) to the EPP's first good
    scrape, over pods started during the run (warm-up included)."""
    done = set(samples[0].started) if samples else set()  # running before the traffic
    seen: dict[str, float] = {}
    waits = []
    for s in samples:
        for a in s.started:
            if a not in done:
                seen.setdefault(a, s.t)
        for a in s.ready:
            if a in seen:
                waits.append((s.t - seen.pop(a)) * scale)
                done.add(a)
    return sum(waits) / len(waits) if waits else math.nan


def summarize(st, results, at: list[float], samples: list[Sample]) -> dict:
    """One mode's figures: `st` the Settings, `results` the client's per request."""
    scale, ramp = st.time_scale, st.ramp
    measured = [(r, a) for r, a in zip(results, at) if a >= ramp.warmup_s]
    met = [r.ok and r.ttft_s * scale <= st.ttft_s for r, _ in measured]
    ttft = [r.ttft_s * scale for r, _ in measured if r.ok]
    phases = {}
    for name, lo, hi in ramp.phases()[1:]:
        idx = [i for i, (_, a) in enumerate(measured) if lo <= a < hi]
        phases[name] = sum(met[i] for i in idx) / len(idx) if idx else math.nan
    w0 = ramp.warmup_s / scale
    return {"attainment": sum(met) / len(met) if met else math.nan,
            "goodput": sum(met) / ramp.duration,
            "pod_seconds": pod_seconds(samples, w0, ramp.end / scale, scale),
            "peak_pods": max((len(s.started) for s in samples if s.t >= w0), default=0),
            "requests": len(measured), "errors": sum(1 for r, _ in measured if not r.ok),
            "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "ttft_p99": _pct(ttft, 99),
            "attainment_by_phase": phases, "pod_start_measured_s": start_latency(samples, scale),
            "pods_over_time": [[round(s.t * scale - ramp.warmup_s, 1), len(s.started), len(s.ready),
                                s.replicas] for s in samples[::25]]}
