"""The idle engine faults the CPU KV cache in without changing a byte of it."""
from __future__ import annotations

import mmap
import resource

import torch

from kvyard.workers.engine.kv_prefault import Prefaulter
from kvyard.workers.engine.model_runner import _zeroed


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_prefault_keeps_written_blocks_and_takes_the_faults_up_front() -> None:
    maps: list[mmap.mmap] = []
    shape = (2, 256, 16, 4, 64)                      # 2 x 256 blocks x 16 KiB = 8 MiB
    cache = _zeroed(shape, torch.float32, torch.device("cpu"), maps)
    assert len(maps) == 1 and len(maps[0]) == cache.numel() * 4
    cache[0, 3].fill_(1.5)                           # a block in use before the prefault
    cache[1, 200].fill_(-2.0)
    p = Prefaulter(maps, chunk=1 << 20)
    steps = 0
    while p.step():
        steps += 1
    assert cache[0, 3].eq(1.5).all() and cache[1, 200].eq(-2.0).all()  # untouched
    assert cache[0, 4].eq(0).all() and cache.sum() == 1.5 * cache[0, 3].numel() \
        - 2.0 * cache[1, 200].numel()
    if p.populated:                                  # the kernel supports it (Linux 5.14+)
        assert steps == 8 and p.populated == len(maps[0])
        before = _minor_faults()
        cache.fill_(0.25)                            # every page now writable: few faults
        assert _minor_faults() - before < 256       # 2048 pages were faulted in already
    assert not p.step()


def test_nothing_to_fault_is_no_work() -> None:
    p = Prefaulter([])
    assert not p.step()
