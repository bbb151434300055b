"""Keep a CPU step's temporaries in memory the process already has.

A decode step allocates the same activations, logits and attention buffers
every time, many above glibc's initial mmap threshold (128 KiB). glibc raises
that threshold (and the heap's trim threshold with it) only after it frees a
large mmapped block; a worker whose weights come memory-mapped from the
weight cache never does, so every such buffer was a fresh mapping, faulted in
page by page and unmapped again, thousands of page faults a step. Fixing the
thresholds where glibc's own rule would end (32 MiB, trim at twice that) makes
the buffers reuse heap memory from the first step on. Process-wide, set once;
nothing happens where the C library has no `mallopt` (not glibc).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


@lru_cache(maxsize=1)
def keep_step_memory() -> bool:
    """Fix glibc's mmap and trim thresholds; True if it took."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
