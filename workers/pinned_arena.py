"""Host frames for CUDA KV saves: pinned slabs, bump-allocated, recycled by reference.

Why an arena rather than a pinned allocation per save: pinning a fresh slab
costs many times the D2H copy into it, while reusing one costs next to nothing
(measured: see docs/benchmarks.md, connector). torch's own pinned cache reuses
as fast but rounds each request up to a power of two (a one-block 8B-class
save, 2 MiB + 80 B, would pin 4 MiB), so the arena asks it only for whole slabs.

The store keeps the frames (its DRAM tier holds views of them), so a slab is
reused only once no view of any run carved from it is left. `locate` maps a
view back to its pinned slab: loads of DRAM hits copy those frames to the GPU
straight from where they lie (kvyard.workers.kvconnector).
"""
from __future__ import annotations

import bisect
import ctypes
import threading
from collections import deque

import numpy as np
import torch

SLAB_BYTES = 32 << 20  # a power of two: one D2H/H2D copy moves at most this much


class PinnedArena:
    """Host frames for CUDA saves, carved from pinned slabs, recycled by reference.

    `carve(frame, n)` returns the next run of up to `n` frames that fits in the
    current slab: a uint8 tensor over it (the D2H copy's target) and an
    `(m, frame)` numpy array over the same bytes (its rows go to the store).
    The numpy array's base is a per-run ctypes object; when the last view of
    the run dies, its `__del__` queues the slab index (a deque append: safe
    from any thread, no lock, so a collection inside `carve` cannot deadlock),
    and `carve` drains that queue. A slab with no live run, other than the one
    being filled, goes back on the free list. `pin=False` uses pageable slabs
    (the benchmark's baseline; tests on machines without CUDA).
    """

    def __init__(self, slab_bytes: int = SLAB_BYTES, pin: bool = True) -> None:
        self.slab_bytes = int(slab_bytes)
        self.pin = pin
        self.pinned_fallbacks = 0
        self._slabs: list[torch.Tensor] = []
        self._live: list[int] = []
        self._free: list[int] = []
        self._cur = -1
        self._off = 0
        self._released: deque[int] = deque()
        self._types: dict[int, type] = {}
        self._lock = threading.Lock()
        self._starts: list[tuple[int, int]] = []  # (address, slab index), sorted
        self._pinned: list[bool] = []

    @property
    def nbytes(self) -> int:
        """Bytes of slabs allocated (pinned unless `pinned_fallbacks`)."""
        return sum(t.numel() for t in self._slabs)

    @property
    def live_slabs(self) -> int:
        self._drain()
        return sum(1 for n in self._live if n > 0)

    def _drain(self) -> None:
        while self._released:
            i = self._released.popleft()
            self._live[i] -= 1
            if self._live[i] == 0 and i != self._cur:
                self._free.append(i)

    def _new_slab(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # the OS would not lock more: keep going, pageable
                self.pinned_fallbacks += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def _run_type(self, nbytes: int) -> type:
        t = self._types.get(nbytes)
        if t is None:
            released = self._released

            def __del__(run, _released=released) -> None:
                try:
                    _released.append(run._slab)
                except Exception:  # noqa: BLE001 - interpreter shutdown
                    pass
            t = type("_Run", (ctypes.c_ubyte * nbytes,), {"__del__": __del__})
            self._types[nbytes] = t
        return t

    def carve(self, frame: int, n: int) -> tuple[torch.Tensor, np.ndarray]:
        with self._lock:
            self._drain()
            fit = (self._slabs[self._cur].numel() - self._off) // frame \
                if self._cur >= 0 else 0
            if fit <= 0:  # (the alignment may step past the end)
                if self._cur >= 0 and self._live[self._cur] == 0:
                    self._free.append(self._cur)
                if self._free:
                    self._cur = self._free.pop()
                else:
                    size = max(self.slab_bytes, 1 << (frame - 1).bit_length())
                    slab = self._new_slab(size)
                    self._slabs.append(slab)
                    self._live.append(0)
                    self._cur = len(self._slabs) - 1
                    self._pinned.append(slab.is_pinned())
                    bisect.insort(self._starts, (slab.data_ptr(), self._cur))
                self._off = 0
                fit = max(1, self._slabs[self._cur].numel() // frame)
            m = min(n, fit)
            slab = self._slabs[self._cur]
            nbytes = m * frame
            run = self._run_type(nbytes).from_address(slab.data_ptr() + self._off)
            run._slab = self._cur
            run._keep = slab  # the slab outlives the arena while the store holds frames
            view = slab[self._off:self._off + nbytes]
            self._live[self._cur] += 1
            self._off += (nbytes + 511) & ~511  # keep runs 512-byte aligned
        return view, np.frombuffer(run, dtype=np.uint8).reshape(m, frame)

    def locate(self, address: int, nbytes: int) -> tuple[torch.Tensor, int, bool] | None:
        """(slab, offset, pinned) for [address, address + nbytes) when one of this
        arena's slabs holds it, else None (other memory)."""
        starts = self._starts
        i = bisect.bisect_right(starts, (address, 1 << 62)) - 1
        if i < 0:
            return None
        base, idx = starts[i]
        slab = self._slabs[idx]
        off = address - base
        if off + nbytes > slab.numel():
            return None
        return slab, off, self._pinned[idx]
