"""`kvyard bench lora`'s workload and verdict (the runs themselves: `--quick`, by hand)."""
from __future__ import annotations

from collections import Counter

from kvyard.bench.lora_route import LoraWorkload, build_requests, policy_configs, verdict
from kvyard.epp.scheduling.config import build_scheduler


def test_requests_are_seeded_zipf_with_an_adapter_prefix() -> None:
    w = LoraWorkload(requests=400, adapters=16, seed=3)
    reqs = build_requests(w)
    assert [(r.adapter, r.text) for r in reqs] == [(r.adapter, r.text) for r in build_requests(w)]
    counts = Counter(r.adapter for r in reqs)
    assert counts.most_common(1)[0][0] == "a00" and counts["a00"] > 3 * counts.get("a15", 0)
    assert all(r.text.startswith(f"You are adapter {r.adapter}.") for r in reqs)
    assert all(b.at_s > a.at_s for a, b in zip(reqs, reqs[1:]))


def test_policies_build_and_the_verdict_reads_the_target() -> None:
    for scorers in policy_configs(4.0).values():
        build_scheduler({"scorers": scorers})
    rows = [{"policy": "lora-affinity+prefix", "adapter_loads": 10.0, "ttft_p90": 0.5},
            {"policy": "prefix", "adapter_loads": 40.0, "ttft_p90": 2.0}]
    assert "4.00x" in verdict(rows)[0] and "met" in verdict(rows)[0]
    rows[1]["adapter_loads"] = 20.0
    assert "NOT met" in verdict(rows)[0]
