"""Keep freed block-sized memory in the process heap instead of returning it to the OS.

Why: the store churns block-sized buffers (360 KiB .. 2 MiB): values parsed off
a Redis reply, frames the connector gathers into, DRAM blocks evicted and
replaced. With glibc's defaults a burst of such frees coalesces at the top of
the heap, exceeds `M_TRIM_THRESHOLD` (2x the dynamic mmap threshold, i.e. a
few MiB) and is handed back with `brk`; the next burst faults every page back
in, and the kernel zeroes each one: a memset per block on top of the copy.
That toll falls on every Redis read of block-sized values and on every fresh
frame a DRAM put fills (measured: see docs/benchmarks.md, kvstore).

Fixing both thresholds (`M_MMAP_THRESHOLD` 32 MiB, the largest glibc allows,
so blocks come from the heap; `M_TRIM_THRESHOLD` 256 MiB) keeps up to that
much free memory for reuse, warm. The process's footprint stays bounded by
what it really holds (the DRAM tier's capacity plus in-flight batches) plus
the trim threshold. Process-wide, so done once, only on glibc, and only when a
store is created; `KVYARD_KV_MALLOC_TUNE=0` leaves the allocator alone.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
# The largest buffer callers should allocate for blocks (the connector's framed
# chunks): below MMAP_THRESHOLD, so it comes from the heap and reuses warm memory.
CHUNK_BYTES = 24 << 20

_done = False


def tune_malloc() -> bool:
    """Apply the thresholds once per process; True if they are (now) in effect."""
    global _done
    if _done:
        return True
    if os.environ.get("KVYARD_KV_MALLOC_TUNE", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok
