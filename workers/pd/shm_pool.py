"""The decode worker's receive buffers for same-host pulls: memfds it owns, kept per
prefill peer and reused.

Why the decode side owns them: a fresh memfd per transfer costs the kernel a page
allocation per 4 KiB (measured slower than loopback TCP for a 96 MB handoff); a
reused one is a plain copy. Why per peer: a prefill worker that kept a buffer's
descriptor past its transfer can read or write only buffers that held its own
frames, never another prefill worker's. Each buffer is sealed against shrinking
and growing (a peer cannot truncate it under this worker's mapping: no SIGBUS)
and allocated up front (`posix_fallocate`), so the prefill worker's writes find
their pages.

A buffer is in use from `take` until the last view of its `array` is gone (the
engine has copied the blocks into its cache): a finalizer gives it back, from
whichever thread drops that view. At most `PER_PEER` free buffers per peer and
`cap_bytes` in all are kept; the rest are closed.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

PER_PEER = 2
ROUND = 16 << 20
DEFAULT_CAP = 1 << 30


@dataclass(slots=True, eq=False)
class ShmBuffer:
    fd: int
    size: int
    mm: mmap.mmap
    base: np.ndarray          # uint8 over the whole mapping
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.base = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:   # a view is still alive somewhere: the GC unmaps it later
            pass
        os.close(self.fd)


def new_buffer(size: int) -> ShmBuffer:
    size = -(-size // ROUND) * ROUND
    fd = os.memfd_create("kvyard-pd-recv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return ShmBuffer(fd, size, mm, np.frombuffer(mm, dtype=np.uint8))


@dataclass(slots=True)
class ShmPool:
    cap_bytes: int = DEFAULT_CAP
    _free: OrderedDict[str, list[ShmBuffer]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    created: int = 0

    def take(self, peer: str, size: int) -> tuple[ShmBuffer, np.ndarray]:
        """A buffer of at least `size` bytes for a pull from `peer`, and the view of its
        first `size` bytes whose lifetime is the buffer's use."""
        buf, small = None, []
        with self._lock:
            bufs = self._free.get(peer, [])
            for i, b in enumerate(bufs):
                if b.size >= size:
                    buf = bufs.pop(i)
                    break
            else:             # too small for this peer's handoffs now: replaced
                small, bufs[:] = list(bufs), []
        for b in small:
            b.close()
        if buf is None:
            buf = new_buffer(size)
            self.created += 1
        view = buf.base[:size]
        weakref.finalize(view, self._give, peer, buf).atexit = False
        return buf, view

    def _give(self, peer: str, buf: ShmBuffer) -> None:
        if buf.closed:
            return
        closing = []
        with self._lock:
            bufs = self._free.setdefault(peer, [])
            self._free.move_to_end(peer)
            bufs.append(buf)
            if len(bufs) > PER_PEER:
                closing.append(bufs.pop(0))
            total = sum(b.size for bs in self._free.values() for b in bs)
            while total > self.cap_bytes and self._free:
                oldest, obufs = next(iter(self._free.items()))
                if obufs:
                    victim = obufs.pop(0)
                    closing.append(victim)
                    total -= victim.size
                if not obufs:
                    del self._free[oldest]
        for b in closing:
            b.close()

    def drop(self, buf: ShmBuffer) -> None:
        """A buffer whose transfer failed is not reused (its peer may misbehave)."""
        with self._lock:
            for bufs in self._free.values():
                if buf in bufs:
                    bufs.remove(buf)
        buf.close()

    def close(self) -> None:
        with self._lock:
            bufs = [b for bs in self._free.values() for b in bs]
            self._free.clear()
        for b in bufs:
            b.close()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.size for bs in self._free.values() for b in bs)
