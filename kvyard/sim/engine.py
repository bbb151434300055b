"""A simulated pod's engine: continuous batching over the block pool, timed by the model.

One asyncio task per pod runs steps, as vLLM's scheduler does: admit waiting requests
first-come first-served while a seat (`max_num_seqs`) and their blocks are free (the
cached prefix shared), then one step whose simulated duration is the prefill of what was
admitted (overhead + uncached tokens x per-token time; a P/D decode pod pays the KV
transfer instead) plus one decode step of everything running (its ITL grows with the
batch). After the step each admitted request has its first token and every decoding one
a token more. A sequence that needs a block the pool cannot give preempts the newest
running one (recomputed later, as vLLM does). The task sleeps on an event while the pod
is idle: no work, no wake-ups.

Output tokens are deterministic filler (a fixed token list, cycled), stopped only by
max_tokens, so two runs of a trace produce the same bytes.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from kvyard.sim.cache import BlockPool, SeqBlocks
from kvyard.sim.latency import LatencyModel
from kvyard.sim.lora import AdapterSlots

REASONS = ("stop", "length", "abort")
log = logging.getLogger("kvyard.sim.engine")


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: str
    prompt_ids: list[int]
    max_tokens: int
    remote_prefill: bool = False      # P/D decode side: the KV arrives, no prefill compute
    adapter: str | None = None        # the LoRA adapter it names (lora.py), None: the base
    output_ids: list[int] = field(default_factory=list)
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    cached_tokens: int = 0
    prefill_left: int = 0             # tokens still to compute before the first token
    prefilled: bool = False
    finish_reason: str | None = None
    aborted: bool = False
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


class SimEngine:
    def __init__(self, pool: BlockPool, model: LatencyModel, max_num_seqs: int,
                 filler: list[int], min_step_s: float = 0.002,
                 publish: Callable[[list[dict[str, Any]]], None] | None = None,
                 max_num_batched_tokens: int = 8192, lora: AdapterSlots | None = None) -> None:
        self.pool = pool
        self.lora = lora
        self._load_s = 0.0  # adapter loads of the step being planned (simulated seconds)
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        self.filler = filler or [0]
        self.min_step_s = min_step_s
        self.publish = publish
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = EngineCounters()
        self.sim_time = 0.0
        self._events: list[dict[str, Any]] = []
        pool.on_event = self._events.append
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ---- the pod's side -----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        if not req.finished:
            req.aborted = True
            self._wake.set()

    @property
    def prompt_tokens_pending(self) -> int:
        """Prompt tokens admitted but not computed yet (queued or mid-prefill)."""
        return sum(len(r.prompt_ids) + len(r.output_ids) for r in self.waiting) + \
            sum(r.prefill_left for r in self.running if not r.prefilled)

    # ---- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            self._drop_aborted()
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - a bug must not leave clients waiting forever
                log.exception("simulated step failed; aborting its requests")
                for r in [*self.running, *self.waiting]:
                    r.aborted = True

    async def step(self) -> None:
        """Admit, plan the step (decodes first, then prefill chunks within the token budget),
        sleep its simulated duration, hand out tokens."""
        loop = asyncio.get_running_loop()
        began = loop.time()  # the step's own work counts towards its duration
        admitted = self._admit()
        decoding = [r for r in self.running if r.prefilled]
        k = self._tokens_per_wake(decoding)
        decoding = self._make_room(decoding, k)
        chunks = self._plan_prefill(self.max_num_batched_tokens - len(decoding))
        remote = [r for r in admitted if r.remote_prefill]
        dur, self._load_s = self._load_s, 0.0
        if chunks:  # the fixed cost once per step that starts a prompt (TTFT's overhead)
            first = any(r.prefill_left == len(r.all_ids) - r.cached_tokens for r, _ in chunks)
            dur += self.model.prefill(sum(n for _, n in chunks), overhead=first)
        for r in remote:
            dur += self.model.transfer(len(r.all_ids) - r.cached_tokens)
        if decoding:
            dur += sum(self.model.itl(len(self.running)) for _ in range(k))
        await asyncio.sleep(max(0.0, began + self.model.real(dur) - loop.time()))
        self.sim_time += dur
        live = set(self.running)
        for r, n in chunks:
            if r in live and not r.aborted:
                r.prefill_left -= n
                if r.prefill_left <= 0:
                    self._prefilled(r)
        for r in remote:
            if r in live and not r.aborted:
                self._prefilled(r)
        for r in decoding:
            if r in live and not r.aborted:
                self._emit(r, min(k, r.remaining))
        for r in [r for r in self.running if r.remaining <= 0]:
            self._finish(r, "length")
        self._flush()

    # ---- internals -------------------------------------------------------------------------
    def _admit(self) -> list[SimRequest]:
        admitted: list[SimRequest] = []
        skipped: list[SimRequest] = []  # their adapter found no slot: they keep their place
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if r.adapter is not None and self.lora is not None:
                cost = self.lora.acquire(r.adapter, {x.adapter for x in self.running})
                if cost is None:
                    skipped.append(self.waiting.popleft())
                    continue
                self._load_s += cost
            cached = self.pool.acquire(r.all_ids, r.blocks, count_query=not r.output_ids)
            if cached is None and not self.running:  # grew past the whole pool: never fits
                self.waiting.popleft()
                self._finish(r, "length")
                continue
            if cached is None:
                break  # first come, first served: the head waits for blocks
            self.waiting.popleft()
            r.cached_tokens = cached
            r.prefill_left = 0 if r.remote_prefill else len(r.all_ids) - cached
            self.running.append(r)
            admitted.append(r)
        self.waiting.extendleft(reversed(skipped))
        return admitted

    def _plan_prefill(self, budget: int) -> list[tuple[SimRequest, int]]:
        """Prefill chunks for this step, first come first served, within `budget` tokens
        (vLLM's chunked prefill: a long prompt no longer stalls every decode for its
        whole prefill)."""
        out: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            if not r.prefilled and r.prefill_left > 0:
                n = min(r.prefill_left, budget)
                out.append((r, n))
                budget -= n
        return out

    def _prefilled(self, r: SimRequest) -> None:
        """The prompt is computed: its blocks are cached and its first token sampled."""
        r.prefilled = True
        r.prefill_left = 0
        self.pool.register(r.all_ids, r.blocks)
        self.counters.prompt_tokens += len(r.prompt_ids)
        self._emit(r, 1)

    def _tokens_per_wake(self, decoding: list[SimRequest]) -> int:
        """Decode steps merged into one wake-up when a step is shorter than `min_step_s` of
        wall time (high --time-scale): bounded CPU, ITL coarsened to that granularity."""
        if not decoding or self.waiting or len(decoding) < len(self.running):
            return 1
        real = self.model.real(self.model.itl_mean(len(self.running)))
        if real <= 0 or real >= self.min_step_s:
            return 1
        return max(1, min(math.ceil(self.min_step_s / real), min(r.remaining for r in decoding)))

    def _make_room(self, decoding: list[SimRequest], k: int) -> list[SimRequest]:
        """Blocks for `k` more tokens of each decoding sequence; the newest running ones are
        preempted (back to the queue's head, recomputed later) when the pool is short."""
        for r in list(decoding):
            while r in self.running and not self.pool.grow(r.blocks, len(r.all_ids) + k):
                victim = self.running.pop()
                self._preempt(victim)
        return [r for r in decoding if r in self.running]

    def _preempt(self, r: SimRequest) -> None:
        if r.prefilled:
            self.pool.register(r.all_ids, r.blocks)
        self.pool.release(r.blocks)
        r.prefilled = False
        r.cached_tokens = r.prefill_left = 0
        self.waiting.appendleft(r)
        self.counters.preemptions += 1

    def _emit(self, r: SimRequest, n: int) -> None:
        if n <= 0:
            return
        f = self.filler
        base = len(r.output_ids)
        r.output_ids.extend(f[(base + i) % len(f)] for i in range(n))
        self.counters.generation_tokens += n
        r.progress.set()

    def _finish(self, r: SimRequest, reason: str) -> None:
        if r in self.running:
            self.running.remove(r)
            if r.prefilled:
                self.pool.register(r.all_ids, r.blocks)
            self.pool.release(r.blocks)
        r.finish_reason = reason
        self.counters.success[reason] = self.counters.success.get(reason, 0) + 1
        r.progress.set()

    def _drop_aborted(self) -> None:
        for r in [r for r in self.running if r.aborted]:
            self._finish(r, "abort")
        if any(r.aborted for r in self.waiting):
            for r in [r for r in self.waiting if r.aborted]:
                self.waiting.remove(r)
                r.finish_reason = "abort"
                self.counters.success["abort"] += 1
                r.progress.set()
        self._flush()

    def flush_events(self) -> None:
        """Publish what the pool reported outside a step (a cache reset)."""
        self._flush()

    def _flush(self) -> None:
        if self._events:
            events, self._events[:] = list(self._events), []
            if self.publish is not None:
                self.publish(events)
