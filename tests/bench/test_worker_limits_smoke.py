"""kvyard.bench.worker_limits' pieces on a real worker: the CPU reading moves, a refused
body is counted, the paired latencies come back."""
from __future__ import annotations

import os
from pathlib import Path

from kvyard.bench import worker_limits as wl
from kvyard.workers.server.testing import start_worker


def test_pieces_measure_a_real_worker(tmp_path: Path, demo_gguf: Path) -> None:
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len", "512",
                      "--kv-cache-memory-bytes", "32MiB", "--num-threads", "1"],
                     tmp_path / "worker.log", env={k: v for k, v in os.environ.items()
                                                   if k != "POD_IP"})
    try:
        assert wl.cpu_ns(w.proc.pid) > 0
        refused = wl.reject_cpu(w.base_url, w.proc.pid, b'{"prompt": ' + b"[" * 100 + b"]" * 100
                                + b"}", runs=1)
        assert refused["statuses"] == [400] and len(refused["cpu_ms"]) == 1
        load = wl.stop_load(w.base_url, [f"s{i}" for i in range(200)], pairs=1, loop=False)
        assert load["stop_statuses"] == [400] and len(load["ratios"]) == 1
    finally:
        assert w.stop() == 0, w.log_tail()
