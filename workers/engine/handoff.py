"""P/D handoff: the engine's KV blocks crossing to or from another worker.

One object per engine, with two faces:
- the engine thread (LLMEngine, Scheduler.postprocess): `open` a prefill's hold
  at admission, `publish` the prompt blocks each step completes, `complete` /
  `fail` it, `reap` what was pulled or expired, and on the decode side
  `load_remote` the blocks a parked request got from its prefill worker;
- any other thread (the peer server, through `AsyncLLMEngine.handoff`): `claim`
  a hold, `wait` for its next blocks, read them (`gather` or `block_pieces`)
  and `finish` it. Nobody writes a held block, so these reads need no lock;
  the holds' own bookkeeping is kv_holds.py's.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence as Seq

import numpy as np
import torch

from .api import RemoteKV
from .block_manager import BlockManager
from .kv_blocks import gather, layout_of, scatter
from .kv_holds import KVHold, KVHolds
from .sequence import Sequence

log = logging.getLogger(__name__)


class Handoff:
    def __init__(self, block_manager: BlockManager, runner: Any, ttl_s: float) -> None:
        self.bm = block_manager
        self.runner = runner         # its kv_caches: read at each use (sleep mode rebuilds them)
        self.holds = KVHolds(ttl_s)
        self.remote_kv_blocks = 0    # decode side: blocks loaded from prefill workers
        # the step loop's wake-up (AsyncLLMEngine): a finished hold's blocks go back next turn
        self.waker: Callable[[], None] | None = None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.runner.kv_caches

    # ---- the engine thread: prefill holds ----------------------------------------
    def open(self, seq: Sequence, hold_id: str | None) -> None:
        """A growing hold for a `hold_kv` request, named `hold_id` if that is free, else
        after the request."""
        seq.kv_hold = (hold_id and self.holds.open(hold_id)) or self.holds.open(seq.request_id)
        if seq.kv_hold is None:
            raise ValueError(f"request id {seq.request_id!r} is already in use")

    def publish(self, seq: Sequence) -> None:
        """The prompt blocks this step completed, referenced for the request's hold (a
        streamed pull may send them now; a preemption cannot free them)."""
        hold, bs = seq.kv_hold, self.bm.block_size
        have = len(hold.block_ids)
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs
        last = seq.num_computed_tokens >= seq.num_prompt_tokens
        if full <= have:
            if last:
                self.holds.complete(hold)
            return
        ids = seq.block_table[have:full]
        self.bm.ref(ids)
        if not self.holds.publish(hold, ids, seq.update_block_hashes(bs)[have:full], last):
            self.bm.release(ids)   # its pull ended already: nobody sends them

    def complete(self, hold: KVHold) -> None:
        self.holds.complete(hold)

    def fail(self, hold: KVHold) -> None:
        """Its request was aborted; unless a pull reads it, its blocks go back now."""
        self.holds.fail(hold)
        self.reap()

    def reap(self) -> int:
        """Give back the blocks of pulled and expired holds; returns how many blocks."""
        n = 0
        for ids in self.holds.reap():
            self.bm.release(ids)
            n += len(ids)
        return n

    def drain(self) -> None:
        """Every hold's blocks back (abort_all, sleep)."""
        for ids in self.holds.drain():
            self.bm.release(ids)

    def next_deadline(self) -> float | None:
        return self.holds.next_deadline()

    # ---- the engine thread: a decode request's remote blocks ----------------------
    def load_remote(self, seq: Sequence, remote: RemoteKV | None) -> None:
        """Write the leading remote blocks that match `seq`'s own hashes into free blocks,
        registered in the prefix cache and pinned to it (`seq.pinned_blocks`) until
        admission. On failure every pin is dropped (the request prefills itself) and the
        error is raised."""
        if remote is None:
            return
        bm, bs = self.bm, self.bm.block_size
        pins = seq.pinned_blocks
        writes: list[tuple[int, object]] = []
        try:
            own = seq.update_block_hashes(bs)
            limit = min((seq.num_tokens - 1) // bs, len(own))
            for i, (h, payload) in enumerate(zip(remote.block_hashes, remote.payloads)):
                if i >= limit or own[i] != h:
                    break
                b = bm.pin_cached(h)
                if b is None:
                    b = bm.take_for(h, own[i - 1] if i else None, seq.token_ids[i * bs:(i + 1) * bs])
                    if b is None:
                        break
                    writes.append((b, payload))
                pins.append(b)
            scatter(self.kv_caches, [b for b, _ in writes], [p for _, p in writes])
        except Exception:
            for b, _ in writes:      # never leave a block cached under a hash it lacks
                bm.uncache(b)
            bm.release(pins)
            seq.pinned_blocks = []
            raise
        self.remote_kv_blocks += len(writes)

    # ---- any thread: the peer server's side ---------------------------------------
    def claim(self, request_id: str, wait_s: float = 0.0) -> KVHold | None:
        """The hold, once (blocking up to `wait_s` for one not opened yet: call from a
        thread when waiting)."""
        return self.holds.claim(request_id, wait_s=wait_s)

    def wait(self, hold: KVHold, have: int, timeout_s: float) -> tuple[int, bool]:
        """See KVHolds.wait (a growing hold's next blocks)."""
        return self.holds.wait(hold, have, timeout_s)

    def finish(self, request_id: str) -> None:
        """The hold's blocks may go back; the engine thread releases them next turn."""
        self.holds.finish(request_id)
        if self.waker is not None:
            self.waker()

    def gather(self, block_ids: Seq[int], out: np.ndarray) -> None:
        """Copy held blocks into `out` (see kv_blocks.gather)."""
        gather(self.kv_caches, block_ids, out)

    def block_pieces(self) -> list[np.ndarray] | None:
        """Per layer, the KV cache as uint8 `[2, blocks, bytes]` views (CPU caches; None
        on a device): a block's payload is, for each layer, its K row then its V row, so
        the peer server can send held blocks from where they lie (see gather)."""
        caches = self.kv_caches
        if caches[0].device.type != "cpu":
            return None
        return [c.view(-1).view(torch.uint8).numpy().reshape(2, c.shape[1], -1) for c in caches]

    @property
    def layout(self) -> Any:
        return layout_of(self.kv_caches)

    def close(self) -> None:
        """Pulls waiting for a hold end now (the engine shut down)."""
        self.holds.close()
