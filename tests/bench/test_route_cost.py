"""`route_cost`'s in-process parts at toy sizes: CPU per request and the precise index."""
from __future__ import annotations

from kvyard.bench.route_cost import index_scale, request_cpu


def test_cpu_per_request_counts_the_decision_and_the_teaching() -> None:
    for policy in ("approx_prefix", "precise_prefix"):
        for shared in (True, False):
            r = request_cpu(endpoints=4, tokens=3000, iterations=2, shared=shared, policy=policy)
            assert 0 < r["decision_cpu_s"] <= r["cpu_s_per_request"], r
            assert (r["policy"], r["shared_prefix"], r["prompt_tokens"]) == (policy, shared, 3000)


def test_index_scale_fills_the_index_and_times_decisions() -> None:
    r = index_scale(endpoints=4, blocks=3000, iterations=6, prompt_tokens=600)
    assert r["indexed_blocks"] >= 3000  # the filler plus the groups' prompts
    assert 0 < r["decision_p50"] <= r["decision_p99"]
    assert r["index_estimate_mb"] > 3000 * 400 / 2**20 and r["requests"] == 6
