"""A simulated pod's KV blocks: a pool of `capacity` blocks and a block-level LRU prefix cache.

It keeps the engine's accounting (workers/engine/block_manager.py) without the tensors:
- a full block is cached under its chained hash (`kvyard.common.hashing.block_hashes`,
  seed 0, the engine's block size), so hit counts and KV-event hashes equal a real
  worker's for the same tokens;
- a prefix lookup stops one token short of the sequence (the last token must run);
- blocks a running sequence holds are pinned; a cached block nobody holds waits in the
  LRU and is evicted (a BlockRemoved event) only when a new block is needed;
- a sequence's blocks are released tail first, so its prefix outlives its tail;
- a block computed twice (two sequences with the same prefix at once) stays private:
  one cached copy per hash.
Events are vLLM's wire dicts (kvyard.common.kv_events), handed to `on_event`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from kvyard.common import kv_events
from kvyard.common.hashing import NONE_HASH, block_hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class SeqBlocks:
    """What one sequence holds: references on cached blocks, a count of private ones,
    and its chain of full-block hashes so far."""

    refs: list[int] = field(default_factory=list)
    private: int = 0
    hashes: list[int] = field(default_factory=list)
    registered: int = 0          # leading full blocks already offered to the cache
    seed: int = 0                # the chain's seed: a LoRA adapter's, so adapters never share KV
    lora_name: str | None = None  # its adapter, in its BlockStored events (vLLM's field)

    @property
    def num_blocks(self) -> int:
        return len(self.refs) + self.private


class BlockPool:
    def __init__(self, capacity: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("--kv-cache-size and --block-size must be positive")
        self.capacity = capacity
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_event = on_event
        self.in_use: dict[int, int] = {}               # hash -> references
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.private = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # ---- queries ---------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.capacity - len(self.in_use) - len(self.lru) - self.private

    @property
    def usage(self) -> float:
        """Share of blocks pinned by sequences (cached-but-free blocks count as free)."""
        return (len(self.in_use) + self.private) / self.capacity

    def cached(self, h: int) -> bool:
        return h in self.in_use or h in self.lru

    def hashes_of(self, token_ids: list[int], seq: SeqBlocks) -> list[int]:
        """`seq.hashes` extended to every full block of `token_ids` (incremental)."""
        done = len(seq.hashes)
        if len(token_ids) // self.block_size > done:
            parent = seq.hashes[-1] if done else NONE_HASH
            seq.hashes += block_hashes(token_ids[done * self.block_size:], self.block_size,
                                       seed=seq.seed, parent=parent)
        return seq.hashes

    def match(self, token_ids: list[int], seq: SeqBlocks) -> int:
        """Leading cached blocks of `token_ids`, one token short of the whole."""
        if not self.enable_prefix_caching:
            return 0
        hashes = self.hashes_of(token_ids, seq)
        limit = (len(token_ids) - 1) // self.block_size
        n = 0
        for h in hashes[:limit]:
            if not self.cached(h):
                break
            n += 1
        return n

    # ---- allocation -------------------------------------------------------------------
    def acquire(self, token_ids: list[int], seq: SeqBlocks, count_query: bool = True) -> int | None:
        """Blocks for all of `token_ids` (an empty `seq`): the cached prefix shared, the
        rest private. Returns the cached tokens, or None (nothing changed) when short."""
        hit = self.match(token_ids, seq)
        hit_hashes = seq.hashes[:hit]
        need = cdiv(len(token_ids), self.block_size) - hit
        from_lru = sum(1 for h in hit_hashes if h in self.lru)
        if need > self.free + len(self.lru) - from_lru:
            return None
        for h in hit_hashes:
            self._ref(h)
        seq.refs = list(hit_hashes)
        seq.registered = hit
        self._take(need)
        seq.private = need
        if count_query:
            self.prefix_queries_tokens += len(token_ids)
            self.prefix_hits_tokens += hit * self.block_size
        return hit * self.block_size

    def grow(self, seq: SeqBlocks, num_tokens: int) -> bool:
        """Room for `num_tokens` in all; False (nothing changed) when the pool is short."""
        need = cdiv(num_tokens, self.block_size) - seq.num_blocks
        if need <= 0:
            return True
        if need > self.free + len(self.lru):
            return False
        self._take(need)
        seq.private += need
        return True

    def register(self, token_ids: list[int], seq: SeqBlocks) -> None:
        """Offer the computed full blocks of `token_ids` to the prefix cache (BlockStored)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.hashes_of(token_ids, seq)
        run: list[int] = []
        run_start = seq.registered
        for i in range(seq.registered, len(hashes)):
            h = hashes[i]
            if self.cached(h) or seq.private == 0:  # someone cached it meanwhile: stays private
                self._emit_stored(run, run_start, token_ids, hashes, seq.lora_name)
                run, run_start = [], i + 1
                continue
            seq.private -= 1
            self.private -= 1
            self.in_use[h] = 1
            seq.refs.append(h)
            run.append(h)
        self._emit_stored(run, run_start, token_ids, hashes, seq.lora_name)
        seq.registered = len(hashes)

    def release(self, seq: SeqBlocks) -> None:
        """Drop everything `seq` holds, tail first."""
        for h in reversed(seq.refs):
            n = self.in_use[h] - 1
            if n:
                self.in_use[h] = n
            else:
                del self.in_use[h]
                self.lru[h] = None
        self.private -= seq.private
        seq.refs, seq.private, seq.registered = [], 0, 0

    def clear(self) -> None:
        """Forget every unreferenced cached block (AllBlocksCleared)."""
        self.lru.clear()
        self._emit(kv_events.all_blocks_cleared())

    # ---- internals --------------------------------------------------------------------
    def _ref(self, h: int) -> None:
        if h in self.lru:
            del self.lru[h]
            self.in_use[h] = 1
        else:
            self.in_use[h] += 1

    def _take(self, n: int) -> None:
        """`n` free blocks become private, evicting the least recently used as needed."""
        short = n - self.free
        if short > 0:
            removed = [self.lru.popitem(last=False)[0] for _ in range(short)]
            self._emit(kv_events.block_removed(removed))
        self.private += n

    def _emit_stored(self, run: list[int], start: int, token_ids: list[int],
                     hashes: list[int], lora_name: str | None = None) -> None:
        if not run:
            return
        bs = self.block_size
        parent = hashes[start - 1] if start else None
        ev = kv_events.block_stored(run, parent, token_ids[start * bs:(start + len(run)) * bs], bs)
        if lora_name is not None:
            ev["lora_name"] = lora_name
        self._emit(ev)

    def _emit(self, ev: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(ev)
