"""The in-process tier: an LRU of read-only payload views, bounded in bytes.

Values are the payload buffers the caller handed to `put` (ownership passes
to the store), held as read-only memoryviews, so a put and a get cost no copy.
Eviction only drops a reference: a reader still holding a view keeps its bytes
alive, so a concurrent eviction can never tear a block under a reader (a slab
arena with reused slots could).

On GPU machines this is where pinned host memory belongs: the connector would
gather blocks into buffers carved from one cudaHostAlloc'd arena, so that
loads are async DMA (H2D) instead of pageable copies. This CPU build uses the
ordinary heap.
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

    def get(self, key: bytes) -> memoryview | None:
        with self._lock:
            mv = self._lru.get(key)
            if mv is None:
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
