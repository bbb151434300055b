"""Continuous batching with chunked prefill, under one per-step token budget.

Each step takes running decodes first (they are latency-critical and cost one
token each), then the unfinished prefill chunks of running requests, then
admits waiting requests in arrival order (a request never jumps the queue:
if the head does not fit, nobody behind it goes). When blocks run out, the
newest running request is preempted and later recomputed; its full blocks
stay in the prefix cache, so recomputation is mostly cache hits.

Prefix reuse happens at admission: local prefix-cache hits first, then a KV
connector (kvstore) may supply further leading blocks.

Connector loads never run on the engine thread (an SSD or Redis hit of a long
prompt takes tens of milliseconds, and every running stream would stall that
long). The head whose next blocks the connector has gets its local hits and
the blocks to load into, referenced and private (not in the prefix cache, so
nobody else can read them half-written), and is *parked*
(WAITING_FOR_KV_LOAD) while a `KVLoader` thread fills them (kv_loads.py).
FCFS, with one exception: the queue does not wait behind a load. Requests
behind it are admitted meanwhile as usual; a request whose next block is
already being loaded for another waits with it instead of loading it twice.
When the load is collected (start of a schedule) the blocks that arrived,
possibly fewer than asked (a miss, a corrupt block, a failed tier: the rest
is computed), enter the prefix cache, and the request takes its place back
in the queue in arrival order, ahead of everyone who came after it, and is
admitted with its blocks as computed. A request aborted while it loads ends
at once; its blocks go back when the load returns, never earlier (the loader
may still be writing them). Parked requests count against `max_num_seqs`.
If the head cannot fit and nothing runs, requests behind it give back what
they hold (P/D pins, loaded blocks: both stay cached, so nothing is lost but
the reference); while loads are in flight an empty step is a wait, not a
stall. The connector's `lookup` (how many blocks it has) still runs here, at
admission: for a Redis tier one round trip for the candidate keys.

P/D: a decode-side request whose prompt is being prefilled elsewhere is
*parked* (WAITING_FOR_REMOTE_KVS, vLLM's name) outside the queue while its KV
travels; the engine loads what arrived as prefix-cache blocks, pinned to the
request, and `unpark` queues it, so admission takes them as ordinary hits.
A prefill-side request marked `hold_kv` has a hold (`seq.kv_hold`,
kv_holds.py) that references its prompt's full blocks as they are computed,
for the decode side to pull, while it runs and after it ends (handoff.py).

After the model ran, `postprocess` advances what was computed, lets the
connector and the handoff see the newly full blocks, appends each sampled
token and ends the sequences that stop (stopping.py), and returns the step's
outputs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .api import RequestOutput
from .block_manager import BlockManager
from .kv_loads import KVLoad, KVLoader
from .sequence import Sequence, SeqStatus, output_of
from .stopping import append_token


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
                 max_num_batched_tokens: int, connector: Any = None,
                 loader: KVLoader | None = None, handoff: Any = None,
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int = 1 << 62,
                 max_loras: int = 0) -> None:
        """`loader` runs the connector's loads (required with a connector); `handoff`
        (handoff.Handoff) sees prompt blocks of P/D prefills as they compute."""
        if connector is not None and loader is None:
            raise ValueError("a KV connector needs a KVLoader")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # admission order: oldest first
        self.requests: dict[str, Sequence] = {}
        self.parked: dict[str, Sequence] = {}    # WAITING_FOR_REMOTE_KVS
        self.loader = loader                     # connector loads, off this thread
        self.handoff = handoff
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_loras = max_loras               # distinct LoRA adapters running at once (0: no LoRA)
        self.loading: dict[str, Sequence] = {}   # WAITING_FOR_KV_LOAD: owners and waiters
        self._loading_hashes: dict[int, KVLoad] = {}  # block hash -> the in-flight load of it
        self.blocked_on_loads = False  # the last step was empty and only a load can change that
        self.num_preemptions = 0
        self.external_hit_tokens = 0
        self.kv_load_failures = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @property
    def loads_in_flight(self) -> int:
        """Connector loads submitted and not yet collected (aborted requests' included)."""
        return 0 if self.loader is None else self.loader.in_flight

    # ---- request lifecycle ---------------------------------------------------
    def add(self, seq: Sequence, parked: bool = False) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.blocked_on_loads = False
        if parked:
            seq.status = SeqStatus.WAITING_FOR_REMOTE_KVS
            self.parked[seq.request_id] = seq
        else:
            self.waiting.append(seq)

    def unpark(self, request_id: str) -> Sequence | None:
        """Queue a parked request (its remote KV arrived, or will not)."""
        seq = self.parked.pop(request_id, None)
        if seq is not None:
            self.blocked_on_loads = False
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request and return its blocks at once (finish, stop, abort alike), but
        for a connector load's owner: its blocks go back when the load is collected."""
        if self.requests.pop(seq.request_id, None) is None:
            return
        self.blocked_on_loads = False
        loading = False
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING_FOR_REMOTE_KVS:
            del self.parked[seq.request_id]
        elif seq.status is SeqStatus.WAITING_FOR_KV_LOAD:
            del self.loading[seq.request_id]
            job = seq.kv_load
            if job.seq is seq:
                job.detached = loading = True   # the loader may still write its blocks
            else:
                job.waiters.remove(seq)
        else:
            self.waiting.remove(seq)
        self._unpin(seq)
        if not loading:                         # else freed when the load is collected
            self.bm.free(seq)                   # a P/D hold has references of its own
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    # ---- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._collect_loads()
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
        self.blocked_on_loads = out.is_empty and bool(self.waiting) and self.loads_in_flight > 0
        return out

    def postprocess(self, sched: SchedulerOutput, samplers: list[Sequence], tokens: list[int],
                    logprobs: list) -> list[RequestOutput]:
        """After the model ran `sched`: its tokens are computed (blocks that became full
        enter the prefix cache, go to the connector and to P/D holds); each sequence in
        `samplers` appends its token and ends if it stops. One output per token.

        Speculative rows (`seq.spec_token_ids`, spec/speculator.py) appear in `samplers`
        once per token they emit; only their last token's position counts as computed
        until the accepted tokens are appended (`_settle_draft`)."""
        drafted: list[Sequence] = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            if seq.spec_token_ids:
                drafted.append(seq)
                n = 1
            self._advance(seq, n)
        outputs: list[RequestOutput] = []
        for seq, tok, lp in zip(samplers, tokens, logprobs):
            if seq.is_finished:             # a stop among a draft's accepted tokens
                continue
            if seq.num_output_tokens == 0:
                self.prompt_tokens_total += seq.num_prompt_tokens
            self.generation_tokens_total += 1
            delta, reason = append_token(seq, tok, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                self.finish(seq, reason)
            out = output_of(seq, [tok], delta, None if lp is None else [lp])
            if seq.kv_hold is not None:
                out.kv_hold = seq.kv_hold
                if reason is not None:      # complete already, unless it ended mid-prompt
                    self.handoff.complete(seq.kv_hold)
            if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 1:
                out.prompt_logprobs = seq.prompt_logprobs or [None]
            outputs.append(out)
        for seq in drafted:
            self._settle_draft(seq)
        return outputs

    def _advance(self, seq: Sequence, n: int) -> None:
        """`n` more tokens computed: newly full blocks enter the prefix cache, go to the
        connector and to the P/D hold."""
        seq.num_computed_tokens += n
        newly = self.bm.cache_blocks(seq)
        if newly and self.connector is not None:
            self.connector.save([h for h, _ in newly], [b for _, b in newly])
        if seq.kv_hold is not None:
            self.handoff.publish(seq)

    def _settle_draft(self, seq: Sequence) -> None:
        """After a verified draft: every emitted token but the last has valid KV (accepted
        drafts were computed at their positions); the rejected positions' blocks go back."""
        seq.spec_token_ids = []
        if seq.is_finished:
            return
        self._advance(seq, seq.num_tokens - 1 - seq.num_computed_tokens)
        keep = -(-seq.num_computed_tokens // self.bm.block_size)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.bm.release(tail)

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
        # LoRA: at most max_loras adapters in the batch; a request whose adapter finds no
        # slot waits and those behind it go ahead (vLLM's rule), in their order
        loras = {s.params.lora_name for s in self.running} - {None} if self.max_loras else None
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 \
                and len(self.running) + len(self.loading) < self.max_num_seqs:
            seq = self.waiting[0]
            lora = seq.params.lora_name
            if loras is not None and lora is not None and lora not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            prefix: list[int] = []
            k = m = 0
            if not seq.block_table:             # else back from a load, holding its blocks
                fresh = seq.wants_prompt_logits  # every prompt position must be computed
                prefix = [] if fresh else self.bm.match_prefix(seq)
                k = len(prefix)
                ask = not fresh and seq.kv_load is None  # the connector, once per admission
                if ask:
                    job = self._load_of(seq, k)
                    if job is not None:         # its next blocks are on their way already
                        self._park(seq, job)
                        job.waiters.append(seq)
                        continue
                m = self._external_blocks(seq, k) if ask else 0
            n = min(seq.num_tokens - seq.num_computed_tokens - (k + m) * bs, budget)
            if m:
                n = 0                           # park it with just the blocks to load into
            if not self.bm.allocate(seq, m * bs + n, prefix):
                if not self.running and self._release_waiting():
                    continue                # blocks held behind the head took the room: retry
                break                       # FCFS: nobody overtakes the head
            self._unpin(seq)                # its remote blocks are now in its block table
            if m:
                self._start_load(seq, k, m)
                continue
            if not seq.admitted_once:
                seq.admitted_once = True
                seq.num_cached_tokens = seq.num_computed_tokens
                local = k if seq.kv_load is None else seq.kv_load.local_blocks
                self.bm.record_prefix_query(seq.num_tokens, local * bs)
            seq.kv_load = None
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n
            if loras is not None and lora is not None:
                loras.add(lora)
        self.waiting.extendleft(reversed(skipped))
        return budget

    # ---- connector loads (kv_loads.py) -----------------------------------------
    def _park(self, seq: Sequence, job: KVLoad) -> None:
        self.waiting.popleft()
        seq.kv_load = job
        seq.status = SeqStatus.WAITING_FOR_KV_LOAD
        self.loading[seq.request_id] = seq

    def _start_load(self, seq: Sequence, k: int, m: int) -> None:
        """The queue head holds its k local hits and m blocks to load into: park it and
        hand the load to the loader thread."""
        job = KVLoad(seq, seq.block_hashes[k:k + m], seq.block_table[k:k + m], k)
        self._park(seq, job)
        for h in job.block_hashes:
            self._loading_hashes[h] = job
        self.loader.submit(job)

    def _load_of(self, seq: Sequence, k: int) -> KVLoad | None:
        """The in-flight load of the block after `seq`'s k local hits, if any (without a
        prefix cache a finished load would not help it: it loads for itself)."""
        if not self._loading_hashes or not self.bm.enable_prefix_caching:
            return None
        hashes = seq.update_block_hashes(self.bm.block_size)
        if k >= min(len(hashes), (seq.num_tokens - 1) // self.bm.block_size):
            return None
        return self._loading_hashes.get(hashes[k])

    def _collect_loads(self) -> None:
        """Finished loads: what arrived enters the prefix cache; the owner and those that
        waited for it go back to the queue (an aborted owner's blocks are freed)."""
        if not self.loads_in_flight:
            return
        bs = self.bm.block_size
        for job in self.loader.completed():
            for h in job.block_hashes:
                if self._loading_hashes.get(h) is job:
                    del self._loading_hashes[h]
            seq = job.seq
            if job.error is not None:
                self.kv_load_failures += 1
            seq.num_computed_tokens = (job.local_blocks + job.loaded) * bs
            self.bm.cache_blocks(seq)       # valid content, whoever needs it next
            if job.detached:
                self.bm.free(seq)
            else:
                del self.loading[seq.request_id]
                self.external_hit_tokens += job.loaded * bs
                self._requeue(seq)
            for w in job.waiters:
                del self.loading[w.request_id]
                w.kv_load = None            # it may ask the connector for blocks past these
                self._requeue(w)
            self.blocked_on_loads = False

    def _requeue(self, seq: Sequence) -> None:
        """Back into the queue in arrival order: ahead of everyone who came after it."""
        seq.status = SeqStatus.WAITING
        i = next((i for i, s in enumerate(self.waiting) if s.arrival > seq.arrival),
                 len(self.waiting))
        self.waiting.insert(i, seq)

    def _unpin(self, seq: Sequence) -> None:
        if seq.pinned_blocks:
            self.bm.release(seq.pinned_blocks)
            seq.pinned_blocks = []

    def _release_waiting(self) -> bool:
        """Drop every queued request's pins and the blocks loaded for those behind the
        head (they stay cached, now evictable), so the head can never wait forever on
        blocks held for those behind it. A request that loses its loaded blocks finds
        them again as local hits (it does not ask the connector twice)."""
        freed = False
        for i, s in enumerate(self.waiting):
            if s.pinned_blocks:
                self._unpin(s)
                freed = True
            if i and s.block_table:
                self.bm.free(s)
                freed = True
        return freed

    def _external_blocks(self, seq: Sequence, num_local: int) -> int:
        """Leading blocks past the local hits that the KV connector can supply."""
        if self.connector is None:
            return 0
        hashes = seq.update_block_hashes(self.bm.block_size)
        limit = (seq.num_tokens - 1) // self.bm.block_size   # keep >= 1 token to compute
        if limit <= num_local:
            return 0
        return max(0, min(int(self.connector.lookup(hashes[num_local:limit])), limit - num_local))
