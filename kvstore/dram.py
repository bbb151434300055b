"""The in-process tier: an LRU of read-only payload views, bounded in bytes.

Values are the payload buffers the caller handed to `put` (ownership passes
to the store), held as read-only memoryviews, so a put and a get cost no copy.
Eviction only drops a reference: a reader still holding a view keeps its bytes
alive, so a concurrent eviction can never tear a block under a reader (a slab
arena with reused slots could).

The tier holds whatever memory the caller's buffers live in. With KV caches
on a CUDA device the connector (kvyard.workers.kvconnector) hands it frames
carved from pinned (page-locked) slabs of its `PinnedArena`, so save's D2H is
a full-speed DMA; a slab is reused only once no view of any frame in it is
left, so the eviction-drops-a-reference rule above holds for pinned memory
too (no reused slot under a live view). With CPU caches the frames are heap
memory. This module never imports torch: pinning is the worker side's job.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from kvyard.kvstore.stats import TierStats


class DramTier:
    name = "dram"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = int(capacity_bytes)
        self.stats = TierStats()
        self._lru: OrderedDict[bytes, memoryview] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def contains(self, key: bytes) -> bool:
        return key in self._lru

    def get(self, key: bytes, accept=None) -> memoryview | None:
        """The payload view, or None. With `accept`, a held view it rejects is None
        too, and counts neither as hit nor miss: the caller reads that block
        another way (KVStore.dram_views)."""
        with self._lock:
            mv = self._lru.get(key)
            if mv is None or (accept is not None and not accept(mv)):
                if accept is None:
                    self.stats.misses += 1
                return None
            self._lru.move_to_end(key)
            self.stats.hits += 1
            return mv

    def put(self, key: bytes, payload) -> bool:
        """Keep `payload` (no copy); False when it can never fit."""
        mv = memoryview(payload).cast("B").toreadonly()
        n = mv.nbytes
        if n > self.capacity:
            return False
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self.stats.bytes -= old.nbytes
            self._lru[key] = mv
            self.stats.bytes += n
            while self.stats.bytes > self.capacity:
                _, victim = self._lru.popitem(last=False)
                self.stats.bytes -= victim.nbytes
                self.stats.evictions += 1
        return True

    def discard(self, key: bytes) -> None:
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self.stats.bytes -= old.nbytes
