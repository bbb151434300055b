"""Prefill-side P/D holds: a prompt's blocks, kept for a decode worker's pull.

A `hold_kv` request gets its hold when it is admitted, empty and *growing*:
after every step the engine thread `publish`es the prompt blocks that became
full and computed, each with a reference of the hold's own, so a streamed
pull can send them while the prefill computes its later chunks, and a
preemption or the request's end cannot free them under the send. The step
that computes the prompt's last chunk publishes its blocks and completes the
hold at once (its deadline starts then); an abort makes it `failed`. The engine thread is the only one to give blocks back to the block
manager (`reap`). The peer server, from its threads, `claim`s a hold once
(waiting a little for one a decode worker asked for before it was admitted),
`wait`s for blocks to send and marks it `done` afterwards. A claimed hold is
never reaped under a transfer; an unclaimed complete one is reaped once its
deadline passes, so a decode worker that never comes costs its blocks for
`ttl_s` only. Hence the lock (and its condition): several threads.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

DEFAULT_TTL_S = 120.0


@dataclass(slots=True, eq=False)
class KVHold:
    request_id: str
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes, in order
    deadline: float = math.inf   # time.monotonic() after which an unclaimed hold is freed
    growing: bool = True         # its request still computes the prompt
    failed: bool = False         # its request was aborted: the hold will not complete
    claimed: bool = False
    done: bool = False


@dataclass(slots=True)
class KVHolds:
    ttl_s: float = DEFAULT_TTL_S
    _holds: dict[str, KVHold] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cond: threading.Condition = field(init=False)
    expired_total: int = 0
    pulled_total: int = 0
    closed: bool = False         # the engine shut down: no hold will come

    def __post_init__(self) -> None:
        self._cond = threading.Condition(self._lock)

    # ---- the engine thread -----------------------------------------------------
    def open(self, request_id: str) -> KVHold | None:
        """A growing hold for an admitted request; None if the id is taken."""
        with self._cond:
            if request_id in self._holds:
                return None
            hold = self._holds[request_id] = KVHold(request_id)
            self._cond.notify_all()
        return hold

    def publish(self, hold: KVHold, block_ids: list[int], block_hashes: list[int],
                last: bool = False) -> bool:
        """Append blocks the caller has just referenced for the hold (`last`: and it is
        complete, in the same breath, so a pull sees the last blocks as the prefill's
        end); False (the caller keeps the references) once the hold is done or complete:
        nobody will send them."""
        with self._cond:
            if hold.done or not hold.growing:
                return False
            hold.block_ids.extend(block_ids)
            hold.block_hashes.extend(block_hashes)
            if last:
                self._complete(hold, None)
            self._cond.notify_all()
        return True

    def complete(self, hold: KVHold, now: float | None = None) -> None:
        """The prompt is computed: the hold has all its blocks, its deadline starts."""
        with self._cond:
            if hold.growing:
                self._complete(hold, now)
            self._cond.notify_all()

    def _complete(self, hold: KVHold, now: float | None) -> None:
        hold.growing = False
        hold.deadline = (time.monotonic() if now is None else now) + self.ttl_s

    def fail(self, hold: KVHold) -> None:
        """Its request was aborted: a pull waiting on it ends, the blocks go back."""
        with self._cond:
            hold.growing, hold.failed = False, True
            hold.deadline = -math.inf
            self._cond.notify_all()

    def add(self, request_id: str, block_ids: list[int], block_hashes: list[int],
            now: float | None = None) -> KVHold:
        """A complete hold of blocks the caller referenced (tests, and holds made whole)."""
        hold = KVHold(request_id, list(block_ids), list(block_hashes[:len(block_ids)]),
                      growing=False)
        hold.deadline = (time.monotonic() if now is None else now) + self.ttl_s
        with self._cond:
            self._holds[request_id] = hold
            self._cond.notify_all()
        return hold

    def reap(self, now: float | None = None) -> list[list[int]]:
        """Block lists to release now: done holds, failed unclaimed ones, and complete
        unclaimed ones past their deadline."""
        t = time.monotonic() if now is None else now
        out: list[list[int]] = []
        with self._cond:
            for rid in [r for r, h in self._holds.items()
                        if h.done or (not h.claimed and not h.growing and t > h.deadline)]:
                hold = self._holds.pop(rid)
                if not hold.done and not hold.failed:
                    self.expired_total += 1
                out.append(hold.block_ids)
        return out

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((h.deadline for h in self._holds.values()
                        if not h.claimed and not h.growing), default=None)

    def drain(self) -> list[list[int]]:
        """Every hold's blocks (shutdown); a pull waiting on one ends."""
        with self._cond:
            out = [h.block_ids for h in self._holds.values()]
            for h in self._holds.values():
                h.growing, h.failed, h.done = False, True, True
            self._holds.clear()
            self._cond.notify_all()
        return out

    def close(self) -> None:
        """Shutdown: pulls waiting for a hold or its blocks end."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    # ---- the peer server's threads --------------------------------------------
    def claim(self, request_id: str, now: float | None = None,
              wait_s: float = 0.0) -> KVHold | None:
        """The hold to send, once: a second claim, an expired or failed hold, or none
        appearing within `wait_s`, gets None."""
        end = time.monotonic() + wait_s
        with self._cond:
            while True:
                hold = self._holds.get(request_id)
                if self.closed:
                    return None
                if hold is not None:
                    t = time.monotonic() if now is None else now
                    if hold.claimed or hold.done or hold.failed or t > hold.deadline:
                        return None
                    hold.claimed = True
                    return hold
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def wait(self, hold: KVHold, have: int, timeout_s: float) -> tuple[int, bool]:
        """Block until the hold has more than `have` blocks or stops growing: (its block
        count, whether it still grows). TimeoutError if neither happens in time,
        RuntimeError if its request failed."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while not hold.failed and not self.closed and hold.growing \
                    and len(hold.block_ids) <= have:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no new block of {hold.request_id} in {timeout_s}s")
                self._cond.wait(left)
            if hold.failed or self.closed:
                raise RuntimeError("the prefill request ended without completing")
            return len(hold.block_ids), hold.growing

    def finish(self, request_id: str) -> None:
        """The transfer ended (sent or failed): the blocks may go back."""
        with self._cond:
            hold = self._holds.get(request_id)
            if hold is not None:
                hold.done = True
                self.pulled_total += 1
                self._cond.notify_all()

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)
