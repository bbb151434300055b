"""The store's write queue: bounded in blocks, filled one `put` call at a time.

Why not `queue.Queue`: a put of N blocks would pay N lock round trips and N
wake-ups of the writer, each with the GIL held, while the Redis sender waits
for the GIL to come back from its sendmsg; a block count under one lock per
call leaves the sender alone. `pending` counts blocks accepted and not yet written
(queued or in flight), so memory stays bounded by `capacity` blocks; `offer`
takes what fits and never waits: writes that do not fit are the caller's to drop.
"""
from __future__ import annotations

import threading
import time
from collections import deque


class WriteQueue:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._items: deque = deque()
        self._pending = 0
        self._closed = False
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # items arrived, or closed
        self._idle = threading.Condition(self._lock)   # pending reached 0

    def offer(self, items: list) -> int:
        """Queue the leading items that fit; how many were taken (0 once closed)."""
        with self._lock:
            room = 0 if self._closed else self.capacity - self._pending
            take = items if len(items) <= room else items[:max(0, room)]
            if take:
                self._items.extend(take)
                self._pending += len(take)
                self._ready.notify()
            return len(take)

    def take(self, most: int) -> list | None:
        """Up to `most` items, waiting for the first; None once closed and drained."""
        with self._lock:
            while not self._items and not self._closed:
                self._ready.wait()
            if not self._items:
                return None
            return [self._items.popleft() for _ in range(min(most, len(self._items)))]

    def done(self, n: int) -> None:
        """`n` taken items have reached their tiers (or failed for good)."""
        with self._lock:
            self._pending -= n
            if self._pending <= 0:
                self._idle.notify_all()

    def join(self, timeout: float) -> bool:
        """Wait until every accepted item is done; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """No more offers; the taker gets None once the queue is drained."""
        with self._lock:
            self._closed = True
            self._ready.notify_all()
