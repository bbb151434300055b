"""Continuous batching with chunked prefill, under one per-step token budget.

Each step takes running decodes first (they are latency-critical and cost one
token each), then the unfinished prefill chunks of running requests, then
admits waiting requests in arrival order (a request never jumps the queue:
if the head does not fit, nobody behind it goes). When blocks run out, the
newest running request is preempted and later recomputed; its full blocks
stay in the prefix cache, so recomputation is mostly cache hits.

Prefix reuse happens at admission: local prefix-cache hits first, then a KV
connector (kvstore) may supply further leading blocks.

P/D: a decode-side request whose prompt is being prefilled elsewhere is
*parked* (WAITING_FOR_REMOTE_KVS, vLLM's name) outside the queue while its KV
travels; the engine loads what arrived as prefix-cache blocks, pinned to the
request, and `unpark` queues it, so admission takes them as ordinary hits.
A prefill-side request marked `hold_kv` keeps its prompt's full blocks when
it finishes (`seq.kv_hold`), for the decode side to pull.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .block_manager import BlockManager
from .sequence import Sequence, SeqStatus


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)   # decodes first, then prefill chunks
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, connector: Any = None) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # admission order: oldest first
        self.requests: dict[str, Sequence] = {}
        self.parked: dict[str, Sequence] = {}    # WAITING_FOR_REMOTE_KVS
        self.num_preemptions = 0
        self.external_hit_tokens = 0

    # ---- request lifecycle ---------------------------------------------------
    def add(self, seq: Sequence, parked: bool = False) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        if parked:
            seq.status = SeqStatus.WAITING_FOR_REMOTE_KVS
            self.parked[seq.request_id] = seq
        else:
            self.waiting.append(seq)

    def unpark(self, request_id: str) -> Sequence | None:
        """Queue a parked request (its remote KV arrived, or will not)."""
        seq = self.parked.pop(request_id, None)
        if seq is not None:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request and return its blocks at once (finish, stop, abort alike)."""
        if self.requests.pop(seq.request_id, None) is None:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING_FOR_REMOTE_KVS:
            del self.parked[seq.request_id]
        else:
            self.waiting.remove(seq)
        self._unpin(seq)
        if seq.hold_kv and reason != "abort":
            seq.kv_hold = self.bm.hold(seq, seq.num_computed_tokens // self.bm.block_size)
        else:
            self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    # ---- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        done: set[str] = set()
        picked: list[tuple[Sequence, int]] = []
        for decode_phase in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                remaining = seq.num_tokens - seq.num_computed_tokens
                if seq.request_id in done or (remaining == 1) != decode_phase:
                    i += 1
                    continue
                n = self._reserve(seq, min(remaining, budget), done, out.preempted)
                if n == 0:          # preempted itself; running[i] is now the next one
                    continue
                picked.append((seq, n))
                done.add(seq.request_id)
                budget -= n
                i += 1
        if not out.preempted:
            budget = self._admit(picked, budget)
        decodes = [(s, n) for s, n in picked if n == 1]
        chunks = [(s, n) for s, n in picked if n != 1]
        for s, n in decodes + chunks:
            out.seqs.append(s)
            out.num_new_tokens.append(n)
        out.num_decodes = len(decodes)
        return out

    def _reserve(self, seq: Sequence, n: int, done: set[str], preempted: list[Sequence]) -> int:
        """Blocks for `n` tokens of a running seq, preempting the newest others until they fit.

        A prefill chunk shrinks to what fits before anyone is preempted for it.
        Returns the tokens granted, 0 if `seq` itself had to be preempted.
        """
        bs = self.bm.block_size
        while True:
            room = len(seq.block_table) * bs - seq.num_computed_tokens + self.bm.num_free_blocks * bs
            take = min(n, room)
            if take > 0 and self.bm.allocate(seq, take):
                return take
            victim = next(s for s in reversed(self.running) if s.request_id not in done)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, picked: list[tuple[Sequence, int]], budget: int) -> int:
        bs = self.bm.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = seq.wants_prompt_logits   # every prompt position must be computed
            prefix = [] if fresh else self.bm.match_prefix(seq)
            k = len(prefix)
            m = 0 if fresh else self._external_blocks(seq, k)
            n = min(seq.num_tokens - (k + m) * bs, budget)
            if not self.bm.allocate(seq, m * bs + n, prefix):
                if not self.running and self._unpin_waiting():
                    continue                # pinned remote blocks held the room: retry
                break                       # FCFS: nobody overtakes the head
            self._unpin(seq)                # its remote blocks are now in its block table
            if m:
                loaded = self.connector.load(seq.block_hashes[k:k + m], seq.block_table[k:k + m])
                loaded = max(0, min(int(loaded), m))
                seq.num_computed_tokens = (k + loaded) * bs
                self.bm.cache_blocks(seq)   # loaded blocks become local prefix-cache entries
                self.external_hit_tokens += loaded * bs
            if not seq.admitted_once:
                seq.admitted_once = True
                seq.num_cached_tokens = seq.num_computed_tokens
                self.bm.record_prefix_query(seq.num_tokens, k * bs)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n
        return budget

    def _unpin(self, seq: Sequence) -> None:
        if seq.pinned_blocks:
            self.bm.release(seq.pinned_blocks)
            seq.pinned_blocks = []

    def _unpin_waiting(self) -> bool:
        """Drop every queued request's pins (the blocks stay cached, now evictable), so
        the queue head can never wait forever on blocks pinned for those behind it."""
        pinned = [s for s in self.waiting if s.pinned_blocks]
        for s in pinned:
            self._unpin(s)
        return bool(pinned)

    def _external_blocks(self, seq: Sequence, num_local: int) -> int:
        """Leading blocks past the local hits that the KV connector can supply."""
        if self.connector is None:
            return 0
        hashes = seq.update_block_hashes(self.bm.block_size)
        limit = (seq.num_tokens - 1) // self.bm.block_size   # keep >= 1 token to compute
        if limit <= num_local:
            return 0
        return max(0, min(int(self.connector.lookup(hashes[num_local:limit])), limit - num_local))
