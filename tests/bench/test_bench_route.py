"""`kvyard bench route`: policy configs the EPP accepts, the pods' counters, the
summary's arithmetic, the plot, and one tiny end-to-end run's JSON."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from kvyard.bench.client import RequestResult
from kvyard.bench.route_metrics import KEYS, PodCounters, RungResult, Slo, parse_counters, pool_delta
from kvyard.bench.route_peers import PEERS
from kvyard.bench.route_plot import svg
from kvyard.bench.route_policies import policies
from kvyard.epp.scheduling.config import build_scheduler, load_config


def test_every_available_policy_is_a_config_the_epp_loads(tmp_path: Path) -> None:
    names = [p.name for p in policies()]
    assert names == ["random", "round_robin", "load", "approx_prefix", "precise_prefix",
                     "precise_prefix_x2", "precise_prefix_x4"]
    assert not any(p.unavailable for p in policies())
    assert [p.replicas for p in policies()][-3:] == [1, 2, 4]
    for p in policies():
        if p.unavailable:
            assert p.unavailable.startswith("unavailable (")
            continue
        sched = build_scheduler(load_config(p.write(tmp_path)))
        assert len(sched.scorers) == len(p.scorers)
    assert next(p for p in policies() if p.name == "random").scorers == []


def test_counters_are_summed_over_label_sets() -> None:
    text = "\n".join([
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0"} 32',
        'vllm:prefix_cache_hits_total{engine="1"} 16',
        "vllm:prefix_cache_queries_total 100",
        'vllm:request_success_total{finished_reason="stop"} 3',
        'vllm:request_success_total{finished_reason="length"} 2',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1',
        "vllm:prefix_cache_hits_created 5"])
    c = parse_counters(text)
    assert (c.hits, c.queries, c.finished, c.block_size, c.num_gpu_blocks) == \
        (48, 100, 5, 16, 1024)


def test_pool_hit_rate_and_imbalance_are_deltas() -> None:
    before = [PodCounters(10, 100, 1), PodCounters(0, 0, 0)]
    after = [PodCounters(40, 200, 4), PodCounters(30, 100, 2)]
    hit, imb = pool_delta(before, after)
    assert hit == (30 + 30) / (100 + 100)
    assert imb == 3 / 2.5
    assert math.isnan(pool_delta(before, before)[1])


def test_summary_goodput_errors_and_sheds() -> None:
    ok = RequestResult(0.5, 0.05, 10, 1.0)
    slow = RequestResult(3.0, 0.05, 10, 3.5)
    shed = RequestResult(math.nan, math.nan, 0, 0.1, error="HTTP 429: saturated")
    bad = RequestResult(math.nan, math.nan, 0, 0.1, error="HTTP 500: boom")
    s = RungResult(4.0, [ok, slow, shed, bad], wall_s=2.0, hit_rate=0.3,
                   imbalance=1.2, ideal_hit_rate=0.5).summary(Slo(2.0, 0.1))
    assert set(KEYS) <= set(s)
    assert s["goodput"] == 0.5 and s["throughput_tok_s"] == 10.0
    assert (s["errors"], s["shed"], s["requests"]) == (1, 1, 4)
    assert s["ttft_p50"] == 1.75


def test_peers_have_distinct_names_and_ports_in_their_commands() -> None:
    assert len({p.name for p in PEERS}) == len(PEERS)
    smg = next(p for p in PEERS if p.package == "smg")
    cmd = smg.command("smg", 1, 2, ["127.0.0.1:3"])
    assert cmd[:2] == ["smg", "launch"] and "http://127.0.0.1:3" in cmd
    assert cmd[cmd.index("--prometheus-port") + 1] == "2"


def test_plot_is_an_svg_with_a_line_per_policy() -> None:
    out = svg({"a": [(1.0, 0.1), (2.0, 0.3)], "b": [(1.0, math.nan), (2.0, 0.2)]}, "t")
    assert out.startswith("<svg") and out.count("<polyline") == 2


def test_tiny_run_reports_every_key(tmp_path: Path) -> None:
    """Two simulated pods, a few requests, one peer when installed: the JSON's shape
    and sane values (the pool never hits more than one infinite cache would)."""
    plot = tmp_path / "ttft.svg"
    argv = [sys.executable, "-m", "kvyard.cli", "bench", "route", "--json",
            "--backend", "sim", "--pods", "2", "--groups", "3", "--prefix-tokens", "64",
            "--users", "2", "--question-tokens", "16", "--output-tokens", "4",
            "--rates", "4", "8", "--duration", "1", "--policies", "random", "approx_prefix",
            "round_robin", "precise_prefix_x2", "--peers", "smg:cache_aware", "--cost-pods", "4",
            "--cost-iterations", "5", "--cost-watch", "0.5", "--plot", str(plot),
            "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert set(doc) == {"config", "policies", "epp_cost"}
    assert doc["config"]["pods"] == 2 and doc["config"]["requests"] == 12
    pol = doc["policies"]
    assert set(pol) == {"random", "approx_prefix", "round_robin", "precise_prefix_x2",
                        "smg:cache_aware"}
    ran = {n: p for n, p in pol.items() if "unavailable" not in p}
    assert {"random", "approx_prefix", "round_robin", "precise_prefix_x2"} <= set(ran)
    for row in ran["round_robin"]["by_rate"]:  # in turn: the pods' counts differ by <= 1
        assert row["imbalance"] <= math.ceil(row["requests"] / 2) / (row["requests"] / 2)
    for name, p in ran.items():
        assert set(KEYS) <= set(p), name
        assert p["errors"] == 0 and p["shed"] == 0, name
        assert 0.0 <= p["hit_rate"] <= p["ideal_hit_rate"] <= 1.0, name
        assert p["ideal_hit_rate"] > 0, name
        assert p["ttft_p50"] <= p["ttft_p90"] <= p["ttft_p99"], name
        assert p["imbalance"] >= 1.0 and p["throughput_tok_s"] > 0, name
        assert [r["rate"] for r in p["by_rate"]] == [4.0, 8.0], name
    assert ran["approx_prefix"]["hit_rate"] > 0 and ran["precise_prefix_x2"]["hit_rate"] > 0
    assert doc["config"]["cache_demand_ratio"] <= 1.0
    if "unavailable" in pol["smg:cache_aware"]:
        assert pol["smg:cache_aware"]["unavailable"] == "not installed"
    cost = doc["epp_cost"]
    assert cost["idle"][0]["pods"] == 4 and cost["idle"][0]["idle_cpu_cores"] >= 0
    d = cost["decisions"][0]
    assert 0 < d["decision_p50"] <= d["decision_p99"] and d["index_mb"] > 0
    assert set(cost["cpu_s_per_request"]) == {"random", "approx_prefix", "round_robin",
                                              "precise_prefix_x2"}
    assert plot.read_text().startswith("<svg")


def test_trace_replay_builds_one_rung_at_the_trace_rate() -> None:
    import argparse

    from kvyard.bench.route import add_arguments, build_workload, pods_for

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--trace", "synthetic", "--trace-limit", "40", "--trace-speedup", "2",
                         "--pods", "4", "--backend", "sim"])
    work, desc = build_workload(args)
    assert len(work.rungs) == 1 and len(work.rungs[0]) == 40 == desc["requests"]
    assert work.rates[0] == 40 / work.rungs[0][-1].at_s
    assert 0 < work.ideal[0] < 1
    pods = pods_for(args, work, desc)
    assert pods.kv_blocks is not None and desc["cache_demand_ratio"] <= 0.73 + 1e-9
    assert pods.max_model_len >= max(r.prompt_tokens + r.output_tokens for r in work.rungs[0])
