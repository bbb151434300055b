"""A CPU step's buffers come from the heap, not fresh mappings (engine/step_memory.py).

Checked in fresh interpreters, whose malloc thresholds are glibc's defaults: a
1 MiB block (an activation's size) is its own mapping there, unless the
thresholds are fixed first."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
if {fix}:
    from kvyard.workers.engine.step_memory import keep_step_memory
    assert keep_step_memory()
before = libc.mallinfo2().hblks
p = libc.malloc(1 << 20)
print(libc.mallinfo2().hblks - before)
"""


def _mapped_blocks(fix: bool) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE.format(fix=fix)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_step_sized_blocks_come_from_the_heap_once_thresholds_are_fixed() -> None:
    assert _mapped_blocks(fix=False) == 1     # glibc's default: a mapping of its own
    assert _mapped_blocks(fix=True) == 0
