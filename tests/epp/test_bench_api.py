"""The benchmark entry point returns real, positive timings of the full decision."""
from __future__ import annotations

from kvyard.bench.epp_api import latencies


def test_decision_latency_runs_over_a_synthetic_pool():
    decide, deferred = latencies(8, 2000, 5, model="demo", shared_fraction=0.5)
    assert len(decide) == len(deferred) == 5
    assert all(0 < t < 5 for t in decide + deferred)
    cpu, _ = latencies(8, 500, 3, model="none", clock="cpu")
    assert len(cpu) == 3 and all(t >= 0 for t in cpu)
