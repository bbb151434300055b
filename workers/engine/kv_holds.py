"""Prefill-side P/D holds: a finished request's prompt blocks, kept for a decode pull.

The engine thread creates a hold when a `hold_kv` request finishes (its block
references pass to the hold) and is the only one to give blocks back to the
block manager (`reap`). The peer server, on the event loop, `claim`s a hold
to send its blocks and marks it `done` afterwards. A claimed hold is never
reaped under a transfer (its blocks must not be reused while they are read);
an unclaimed one is reaped once its deadline passes, so a decode worker that
never comes costs its blocks for `ttl_s` only. Hence the lock: two threads.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

DEFAULT_TTL_S = 120.0


@dataclass(slots=True)
class KVHold:
    request_id: str
    block_ids: list[int]
    block_hashes: list[int]      # chained hashes of those blocks, in order
    deadline: float              # time.monotonic() after which an unclaimed hold is freed
    claimed: bool = False
    done: bool = False


@dataclass(slots=True)
class KVHolds:
    ttl_s: float = DEFAULT_TTL_S
    _holds: dict[str, KVHold] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    expired_total: int = 0
    pulled_total: int = 0

    def add(self, request_id: str, block_ids: list[int], block_hashes: list[int],
            now: float | None = None) -> KVHold:
        t = time.monotonic() if now is None else now
        hold = KVHold(request_id, list(block_ids), list(block_hashes[:len(block_ids)]),
                      t + self.ttl_s)
        with self._lock:
            self._holds[request_id] = hold
        return hold

    def claim(self, request_id: str, now: float | None = None) -> KVHold | None:
        """The hold to send, once: a second claim (or an expired hold) gets None."""
        t = time.monotonic() if now is None else now
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.claimed or hold.done or t > hold.deadline:
                return None
            hold.claimed = True
            return hold

    def finish(self, request_id: str) -> None:
        """The transfer ended (sent or failed): the blocks may go back."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is not None:
                hold.done = True
                self.pulled_total += 1

    def reap(self, now: float | None = None) -> list[list[int]]:
        """Block lists to release now: done holds, and unclaimed ones past their deadline."""
        t = time.monotonic() if now is None else now
        out: list[list[int]] = []
        with self._lock:
            for rid in [r for r, h in self._holds.items()
                        if h.done or (not h.claimed and t > h.deadline)]:
                hold = self._holds.pop(rid)
                if not hold.done:
                    self.expired_total += 1
                out.append(hold.block_ids)
        return out

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((h.deadline for h in self._holds.values() if not h.claimed), default=None)

    def drain(self) -> list[list[int]]:
        """Every hold's blocks (shutdown)."""
        with self._lock:
            out = [h.block_ids for h in self._holds.values()]
            self._holds.clear()
        return out

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)
