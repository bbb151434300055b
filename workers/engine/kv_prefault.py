"""Faulting the CPU KV cache in while the engine idles.

The CPU cache is an anonymous mapping the kernel fills page by page on first
touch (model_runner._zeroed), so a worker starts without zeroing it. The first
write to each page then pays a fault and a zeroing instead: 94 MB of P/D
handoff written into untouched blocks took ~100 ms, into touched ones ~12 ms.
So whenever the engine has nothing to run, it asks the kernel to populate the
next few MiB writable (`MADV_POPULATE_WRITE`, Linux 5.14+). That never changes
a byte, so blocks already in use are safe; where the kernel lacks it, nothing
happens and pages fault in on first use as before.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@dataclass(slots=True)
class Prefaulter:
    maps: list[mmap.mmap] = field(default_factory=list)
    chunk: int = 4 << 20       # one step's work: a few ms, so a new request barely waits
    populated: int = 0
    _i: int = 0
    _off: int = 0

    def step(self) -> bool:
        """Populate the next chunk; False once all of it is (or cannot be)."""
        while self._i < len(self.maps):
            m = self.maps[self._i]
            if self._off >= len(m):
                self._i, self._off = self._i + 1, 0
                continue
            n = min(self.chunk, len(m) - self._off)
            try:
                m.madvise(MADV_POPULATE_WRITE, self._off, n)
            except (OSError, ValueError):  # an older kernel: pages fault in on use
                self._i = len(self.maps)
                return False
            self._off += n
            self.populated += n
            return True
        return False
