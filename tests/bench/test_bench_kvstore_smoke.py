"""`kvyard bench kvstore` end to end at tiny sizes: DRAM, SSD and a real redis-server
the bench starts itself, on one CPU.

No timing assertions (shared CI machines): the report's shape, that every row
moved bytes on both sides, and that a narrowed CPU set is what the report
counts and explains (the Redis put row depends on spare cores, not the host's).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="needs redis-server")


def test_bench_kvstore_on_one_cpu_reports_its_rows_and_the_cpu_note(tmp_path) -> None:
    cpu = min(os.sched_getaffinity(0))
    argv = [sys.executable, "-m", "kvyard.cli", "bench", "kvstore", "--tiers", "dram,ssd,redis",
            "--layouts", "demo", "--mb", "8", "--repeat", "1", "--no-ttft",
            "--ssd-dir", str(tmp_path), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)["throughput"]

    rows = report["rows"]
    assert [(r["tier"], r["op"]) for r in rows] == [
        ("dram", "put"), ("dram", "get"), ("ssd", "put"), ("ssd", "get"),
        ("redis", "put"), ("redis", "get")]
    for r in rows:
        assert r["layout"] == "demo" and r["block_kib"] == 360
        for k in ("store_gbps", "ref_gbps", "ratio"):
            assert math.isfinite(r[k]) and r[k] > 0, (r, k)
        assert r["ok"] == ("yes" if r["ratio"] >= r["target"] else "NO")
    assert report["meta"]["cpus"] == 1  # the affinity, not os.cpu_count()
    notes = "\n".join(report["notes"])
    assert "only 1 usable CPUs" in notes and "Redis put ratio" in notes
    assert "errors during" not in notes
    assert os.listdir(tmp_path) == []  # the bench's temp dir is gone
