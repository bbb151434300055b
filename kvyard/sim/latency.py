"""The latency model: what a simulated step costs, in simulated seconds, and the clock.

`--time-scale S` runs simulated time S times faster than the wall clock: every sleep is
divided by S. What it distorts: everything outside the model keeps wall-clock speed, so
at S > 1 the EPP's scrape interval, flow-control TTLs, Envoy timeouts, client think times
and the autoscaler's idle/polling periods are S times *longer* in simulated time; rates
the EPP measures from counters (prefill tokens/s for the KEDA scaler) read S times higher;
and the simulator's own CPU cost per step (HTTP, JSON, the event loop) does not shrink,
so at high S a busy pool falls behind its model (steps shorter than `min_step` are merged,
several tokens per wake-up, which coarsens ITL to that granularity). Use it when only the
model's dynamics matter (cache hit rates, queueing under a trace), not for timings
against real components.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvyard.sim.profiles import LatencyProfile

_MAX_DEVIATION = 0.7  # as llm-d-inference-sim: jitter never moves a value more than 70%


@dataclass(slots=True)
class LatencyModel:
    profile: LatencyProfile
    time_scale: float = 1.0
    seed: int | None = None
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        self.rng = random.Random(self.seed)

    # ---- means (deterministic: what tests assert on) -------------------------------
    def prefill_mean(self, uncached_tokens: int, overhead: bool = True) -> float:
        """TTFT's compute: the fixed cost (once per step that starts a prompt) plus the
        uncached tokens; a chunk that continues a prompt pays only its tokens."""
        p = self.profile
        return (p.prefill_overhead if overhead else 0.0) + \
            max(0, uncached_tokens) * p.prefill_time_per_token

    def itl_mean(self, running: int) -> float:
        p = self.profile
        return p.inter_token_latency + max(0, running - 1) * p.itl_per_running_seq

    def transfer_mean(self, tokens: int) -> float:
        p = self.profile
        return p.kv_transfer_latency + max(0, tokens) * p.kv_transfer_time_per_token

    # ---- samples ----------------------------------------------------------------------
    def _jitter(self, mean: float, std: float) -> float:
        if std <= 0 or mean <= 0:
            return mean
        v = self.rng.gauss(mean, std)
        return min(mean * (1 + _MAX_DEVIATION), max(mean * (1 - _MAX_DEVIATION), v))

    def prefill(self, uncached_tokens: int, overhead: bool = True) -> float:
        return self._jitter(self.prefill_mean(uncached_tokens, overhead),
                            self.profile.prefill_time_std_dev)

    def itl(self, running: int) -> float:
        return self._jitter(self.itl_mean(running), self.profile.inter_token_latency_std_dev)

    def transfer(self, tokens: int) -> float:
        return self._jitter(self.transfer_mean(tokens), self.profile.kv_transfer_std_dev)

    # ---- the clock ----------------------------------------------------------------------
    def real(self, sim_seconds: float) -> float:
        """Wall-clock seconds for `sim_seconds` of simulated time."""
        return sim_seconds / self.time_scale
