"""Paged KV blocks: ref counts, per-sequence block tables, and the prefix cache.

A full block is registered under its chained hash (`kvyard.common.hashing`),
so any later request with the same prefix reuses it instead of recomputing.
Freed blocks keep their content: they wait in the free queue, least recently
used first, and only lose their hash when the queue hands them out again.
Blocks that hold nothing reusable go to the front of that queue, so cached
content is the last thing we give up.

Every registration and eviction is reported to `listeners` as a `KVEvent`:
that seam becomes vLLM-style KV events for the router without the block
manager knowing who listens.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

from .sequence import Sequence


@dataclass(slots=True)
class KVEvent:
    """`kind` is "stored" (blocks entered the prefix cache), "removed" (evicted) or
    "all_cleared" (the whole cache dropped: sleep mode; no hashes)."""

    kind: str
    block_hashes: list[int]
    parent_block_hash: int | None = None      # "stored": hash of the block before the first
    token_ids: list[int] = field(default_factory=list)  # "stored": the blocks' tokens
    block_size: int = 0
    lora_name: str | None = None              # "stored": the adapter the blocks were computed with


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache holds no block: raise kv_cache_memory_bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                     # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.listeners: list[Callable[[KVEvent], None]] = []
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks pinned by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_prefix_blocks: int = 0) -> int:
        have = len(seq.block_table) + num_prefix_blocks
        total = seq.num_computed_tokens + num_prefix_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: Seq[int] = ()) -> bool:
        return self.blocks_needed(seq, num_new_tokens, len(prefix_blocks)) <= self._available(prefix_blocks)

    def can_append(self, seq: Sequence) -> bool:
        """Room for one more token (a decode step)."""
        return self.can_allocate(seq, 1)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`.

        Stops one token short of the whole sequence: the last token must run
        through the model to give the logits we sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = seq.update_block_hashes(self.block_size)
        limit = (seq.num_tokens - 1) // self.block_size
        out: list[int] = []
        for h in hashes[:limit]:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_tokens
        self.prefix_hits_tokens += num_hit_tokens

    # ---- allocation ----------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: Seq[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens; False (and no change) if short.

        `prefix_blocks` (from `match_prefix`, only for a sequence holding no
        blocks) are shared rather than copied, and count as computed.
        """
        if prefix_blocks and seq.block_table:
            raise ValueError("prefix blocks can only start an empty block table")
        need = self.blocks_needed(seq, num_new_tokens, len(prefix_blocks))
        if need > self._available(prefix_blocks):
            return False
        for b in prefix_blocks:
            self._touch(b)
        if prefix_blocks:
            seq.block_table.extend(prefix_blocks)
            seq.num_computed_tokens = len(prefix_blocks) * self.block_size
            seq.num_cached_blocks = len(prefix_blocks)
        if need:
            seq.block_table.extend(self._take(need))
        return True

    def cache_blocks(self, seq: Sequence) -> list[tuple[int, int]]:
        """Register the blocks that became full and computed; returns their (hash, block id).

        A block whose hash is already cached under another id stays private
        (it is freed to the front of the queue later): one copy per prefix.
        """
        n_full = seq.num_computed_tokens // self.block_size
        start = seq.num_cached_blocks
        if n_full <= start:
            return []
        hashes = seq.update_block_hashes(self.block_size)
        newly = [(hashes[i], seq.block_table[i]) for i in range(start, n_full)]
        seq.num_cached_blocks = n_full
        if self.enable_prefix_caching:
            stored: list[int] = []
            for h, b in newly:
                if h not in self.cached and self.block_hash[b] is None:
                    self.cached[h] = b
                    self.block_hash[b] = h
                    stored.append(h)
            if stored and self.listeners:
                bs = self.block_size
                self._emit(KVEvent(
                    "stored", stored,
                    parent_block_hash=hashes[start - 1] if start else None,
                    token_ids=seq.token_ids[start * bs:n_full * bs],
                    block_size=bs,
                    lora_name=seq.params.lora_name,
                ))
        return newly

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first so its prefix outlives its tail."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def ref(self, block_ids: Seq[int]) -> None:
        """One more reference on blocks in use (a P/D hold's, released with `release`)."""
        for b in block_ids:
            self._touch(b)

    def release(self, block_ids: Seq[int]) -> None:
        """Drop references taken by `ref` or `pin_cached` (tail first, as `free`)."""
        for b in reversed(block_ids):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def pin_cached(self, block_hash: int) -> int | None:
        """Reference the cached block under `block_hash`, if any; returns its id."""
        b = self.cached.get(block_hash) if self.enable_prefix_caching else None
        if b is not None:
            self._touch(b)
        return b

    def take_for(self, block_hash: int, parent_hash: int | None,
                 token_ids: list[int]) -> int | None:
        """A referenced free block to fill with the content of `block_hash`, registered
        in the prefix cache under it (the caller writes its KV before anything reads it:
        both happen on the engine thread). None when no block is free."""
        if not self.free_queue or not self.enable_prefix_caching:
            return None
        b = self._take(1)[0]
        self.cached[block_hash] = b
        self.block_hash[b] = block_hash
        if self.listeners:
            self._emit(KVEvent("stored", [block_hash], parent_block_hash=parent_hash,
                               token_ids=token_ids, block_size=self.block_size))
        return b

    def uncache(self, b: int) -> None:
        """Forget block `b`'s hash (its content was never written)."""
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the KV cache's contents are gone: sleep mode); only
        with no block in use. Listeners hear one "all_cleared" event (vLLM's AllBlocksCleared)."""
        if any(self.ref_cnt):
            raise RuntimeError("reset_prefix_cache with blocks in use")
        self.block_hash = [None] * self.num_blocks
        self.cached.clear()
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        if self.listeners:
            self._emit(KVEvent("all_cleared", [], block_size=self.block_size))

    # ---- internals -----------------------------------------------------------
    def _available(self, prefix_blocks: Seq[int]) -> int:
        return len(self.free_queue) - sum(1 for b in prefix_blocks if self.ref_cnt[b] == 0)

    def _touch(self, b: int) -> None:
        if self.ref_cnt[b] == 0:
            del self.free_queue[b]
        self.ref_cnt[b] += 1

    def _take(self, n: int) -> list[int]:
        out: list[int] = []
        removed: list[int] = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
                    removed.append(h)
            self.ref_cnt[b] = 1
            out.append(b)
        if removed and self.listeners:
            self._emit(KVEvent("removed", removed, block_size=self.block_size))
        return out

    def _emit(self, ev: KVEvent) -> None:
        for fn in self.listeners:
            fn(ev)
