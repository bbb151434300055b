"""Per-replica capacity, measured online from the endpoints' own counters.

The KEDA scaler (`server.py`) divides demand by capacity, so capacity must come
from what the workers actually do, not from a number someone typed once. Every
good scrape is fed to `Capacity.observe`; per endpoint, scrapes are gathered
into windows of at least `window_s` seconds (a 50 ms scrape sees too few
tokens to be a rate), and each window yields samples for the estimates of its
endpoint's role. The estimates are kept per role, not per endpoint, so they
outlive the endpoints that produced them: a pool scaled to zero still knows
what one replica does when it wakes. Until a role has a sample, the configured
fallback stands.

* Prefill rate (prompt tokens/s per replica): `Δvllm:prompt_tokens_total / Δt`.
  A window in which the endpoint had a queue at every scrape ran at capacity:
  the estimate moves toward it (EWMA). Any other window ran at demand, which
  is a lower bound: the estimate is raised toward it (the same EWMA) if lower, not to
  it, since one window's rate is noisy (the counter advances by whole prompts) and the
  largest of many noisy windows would overstate the rate.
* Prompt length (tokens per request): `Σ Δprompt_tokens / Σ Δvllm:request_success_total`
  over the recent windows (both sums decay alike), which turns queued requests into
  prompt tokens. A ratio of sums, not a mean of per-window ratios: a request is
  prefilled in one window and counted finished in a later one, and the requests
  running now (prefilled, not finished) join the denominator.
* Decode time per output token as a function of batch size: a window with
  mean decoding batch `b` (running requests less those still mid-prefill, which generate
  nothing yet: `kvyard:prompt_tokens_pending` beyond the waiting requests' prompts, in
  prompts of the measured length) and `Δvllm:generation_tokens_total = g` gives each
  sequence's TPOT `t = b·Δt / g`. The samples fit `t = a + c·b` by least
  squares with forgetting; the capacity at a TPOT objective is the batch
  `(objective − a) / c` at which the fit reaches it. Without a spread of batch
  sizes (or a slope too small to tell from flat) it is the proportional estimate
  `objective · b̄ / t̄`, which assumes TPOT grows in proportion to the batch and
  therefore errs towards more replicas.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..pool.endpoints import Endpoint
from ..pool.metrics_parse import WorkerMetrics

_EWMA = 0.3  # weight of a new window: a few windows to settle, one outlier does not dominate
_FORGET = 0.97  # per-window forgetting of the TPOT fit: about 30 windows of memory
_FORGET_PROMPT = 0.9  # the prompt-length sums: about 10 windows
_MIN_SPREAD = 0.25  # variance of batch sizes (sequences²) below which the slope is not trusted
_MIN_GEN_TOKENS = 4  # fewer generated tokens in a window say nothing about TPOT
# A slope that explains less than this share of the mean TPOT is noise: extrapolating a
# flat line would promise unbounded batches.
_MIN_SLOPE_SHARE = 0.05


@dataclass(slots=True)
class Fallback:
    """What one replica is assumed to do until measured."""

    prefill_tokens_per_s: float = 2000.0
    prompt_tokens: float = 512.0
    decode_tpot_s: float = 0.025  # per-sequence TPOT at `decode_batch`
    decode_batch: float = 8.0


@dataclass(slots=True)
class _Window:
    t0: float
    prompt0: float
    gen0: float
    done0: float
    running_sum: float = 0.0
    scrapes: int = 0
    queued_throughout: bool = True


@dataclass(slots=True)
class RoleCapacity:
    """One role's estimates; `None` fields are not measured yet."""

    prefill_tokens_per_s: float | None = None
    windows: int = 0
    _prompt_sum: float = 0.0  # decayed Σ prompt tokens and Σ finished requests
    _done_sum: float = 0.0
    in_flight: float = 0.0  # Σ running on the role's endpoints at their last window
    # exponentially weighted sums of (b, t) samples for the TPOT fit
    _w: float = 0.0
    _sb: float = 0.0
    _st: float = 0.0
    _sbb: float = 0.0
    _sbt: float = 0.0

    def add_prefill(self, rate: float, at_capacity: bool) -> None:
        cur = self.prefill_tokens_per_s
        if cur is None:
            self.prefill_tokens_per_s = rate
        elif at_capacity or rate > cur:
            self.prefill_tokens_per_s = cur + _EWMA * (rate - cur)

    def add_requests(self, prompt_tokens: float, finished: float) -> None:
        self._prompt_sum = self._prompt_sum * _FORGET_PROMPT + prompt_tokens
        self._done_sum = self._done_sum * _FORGET_PROMPT + finished

    @property
    def prompt_tokens(self) -> float | None:
        done = self._done_sum + self.in_flight
        if done < 1.0 or self._prompt_sum <= 0.0:
            return None
        return self._prompt_sum / done

    def add_tpot(self, batch: float, tpot: float) -> None:
        f = _FORGET
        self._w = self._w * f + 1.0
        self._sb = self._sb * f + batch
        self._st = self._st * f + tpot
        self._sbb = self._sbb * f + batch * batch
        self._sbt = self._sbt * f + batch * tpot

    @property
    def decode_measured(self) -> bool:
        return self._w > 0.0

    def decode_sequences(self, tpot_objective_s: float, fb: Fallback) -> float:
        """Sequences one replica runs at the TPOT objective (≥ 1)."""
        if self._w <= 0.0:
            return max(1.0, tpot_objective_s * fb.decode_batch / fb.decode_tpot_s)
        mb, mt = self._sb / self._w, self._st / self._w
        var = self._sbb / self._w - mb * mb
        if var >= _MIN_SPREAD:
            c = (self._sbt / self._w - mb * mt) / var
            if c > 0.0 and c * mb >= _MIN_SLOPE_SHARE * mt:
                a = mt - c * mb
                return max(1.0, (tpot_objective_s - a) / c)
        return max(1.0, tpot_objective_s * mb / mt) if mt > 0.0 else 1.0

    def prefill_rate(self, fb: Fallback) -> float:
        return self.prefill_tokens_per_s or fb.prefill_tokens_per_s

    def prompt_len(self, fb: Fallback) -> float:
        return self.prompt_tokens or fb.prompt_tokens

    def snapshot(self, tpot_objective_s: float, fb: Fallback) -> dict:
        return {"prefill_tokens_per_s": round(self.prefill_rate(fb), 3),
                "prompt_tokens": round(self.prompt_len(fb), 3),
                "decode_sequences": round(self.decode_sequences(tpot_objective_s, fb), 3),
                "measured": {"prefill": self.prefill_tokens_per_s is not None,
                             "prompt": self.prompt_tokens is not None,
                             "decode": self.decode_measured},
                "windows": self.windows}


@dataclass(slots=True)
class Capacity:
    """Feeds windows of scrapes into per-role estimates. Call `observe` after each
    good scrape (the scraper's observer) and `forget` when an endpoint leaves."""

    window_s: float = 1.0
    fallback: Fallback = field(default_factory=Fallback)
    roles: dict[str, RoleCapacity] = field(default_factory=dict)
    _windows: dict[str, _Window] = field(default_factory=dict)
    _running: dict[str, tuple[str, float]] = field(default_factory=dict)  # addr -> role, running

    def role(self, role: str) -> RoleCapacity:
        rc = self.roles.get(role)
        if rc is None:
            rc = self.roles[role] = RoleCapacity()
        return rc

    def forget(self, address: str) -> None:
        self._windows.pop(address, None)
        gone = self._running.pop(address, None)
        if gone is not None:
            self._update_in_flight(gone[0])

    def _update_in_flight(self, role: str) -> None:
        self.role(role).in_flight = sum(r for ro, r in self._running.values() if ro == role)

    def observe(self, ep: Endpoint, m: WorkerMetrics, now: float) -> None:
        if m.prompt_tokens is None or m.generation_tokens is None:
            return  # a server without vLLM's counters: nothing to measure
        done = m.finished or 0.0
        w = self._windows.get(ep.address)
        if (w is None or m.prompt_tokens < w.prompt0 or m.generation_tokens < w.gen0
                or done < w.done0):  # first scrape, or the counters reset (a restart)
            self._windows[ep.address] = _Window(now, m.prompt_tokens, m.generation_tokens, done)
            return
        w.running_sum += m.running - self._prefilling(ep.role, m)
        w.scrapes += 1
        w.queued_throughout = w.queued_throughout and m.waiting > 0
        dt = now - w.t0
        if dt < self.window_s:
            return
        self._running[ep.address] = (ep.role, m.running)
        self._update_in_flight(ep.role)
        self._close(ep.role, w, dt, m.prompt_tokens - w.prompt0, m.generation_tokens - w.gen0,
                    done - w.done0)
        self._windows[ep.address] = _Window(now, m.prompt_tokens, m.generation_tokens, done)

    def _prefilling(self, role: str, m: WorkerMetrics) -> float:
        """Running requests still mid-prefill (vLLM counts them as running), from the
        pending prompt tokens the waiting requests do not account for."""
        if not m.prompt_tokens_pending or m.running <= 0:
            return 0.0
        plen = max(1.0, self.role(role).prompt_len(self.fallback))
        mid = max(0.0, m.prompt_tokens_pending - m.waiting * plen)
        return min(float(m.running), math.ceil(mid / plen - 1e-9))

    def _close(self, role: str, w: _Window, dt: float, prompt: float, gen: float,
               done: float) -> None:
        rc = self.role(role)
        rc.windows += 1
        if prompt > 0:
            rc.add_prefill(prompt / dt, at_capacity=w.queued_throughout)
        if prompt > 0 or done > 0:
            rc.add_requests(prompt, done)
        batch = w.running_sum / w.scrapes if w.scrapes else 0.0
        if role != "prefill" and batch >= 0.5 and gen >= _MIN_GEN_TOKENS:
            rc.add_tpot(batch, batch * dt / gen)
