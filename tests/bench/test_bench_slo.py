"""`kvyard bench slo`: its policies are configs the EPP loads, the autoscaling model, and
the EPP learning from responses through Envoy (the path the bench measures)."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import aiohttp

from kvyard.bench import route_stack
from kvyard.bench.route_policies import Policy
from kvyard.bench.route_stack import Pods
from kvyard.bench.slo import _policies
from kvyard.bench.slo_autoscale import PodModel, compare
from kvyard.epp.scheduling.config import build_scheduler, load_config


def test_policies_are_configs_the_epp_loads(tmp_path: Path) -> None:
    pols = _policies()
    assert list(pols) == ["load", "precise_prefix", "precise_prefix+latency", "+admission"]
    for name, scorers in pols.items():
        sched = build_scheduler(load_config(Policy(name, scorers).write(tmp_path)))
        assert len(sched.scorers) == len(scorers)


def test_predictive_scaling_starts_pods_before_the_ramp_needs_them() -> None:
    r = compare(base=8.0, max_pods=16, start_s=30.0)
    assert r["predictive"]["attainment"] > r["reactive"]["attainment"] + 0.05
    assert r["predictive"]["pod_seconds"] <= 1.1 * r["reactive"]["pod_seconds"]
    spare = r["spare"]  # pods ready in a second: both keep up, the spike included
    assert spare["predictive"]["attainment"] >= 0.9 and spare["reactive"]["attainment"] >= 0.9
    assert PodModel().capacity > 0


def test_the_epp_learns_ttft_tpot_and_output_length_through_envoy(tmp_path: Path) -> None:
    scorers = [{"type": "prefix-cache", "weight": 3},
               {"type": "latency", "weight": 4, "minSamples": 2}]
    stack = route_stack.start(Pods("sim", 2, "h100", 512, 4096, 0, 1.0), tmp_path,
                              Policy("lat", scorers).write(tmp_path), observe_responses=True)
    try:
        async def send() -> list[int]:
            h = {"x-llm-d-slo-ttft-ms": "500", "x-llm-d-slo-tpot-ms": "50",
                 "x-llm-d-inference-fairness-id": "tenant-a"}
            out = []
            async with aiohttp.ClientSession(headers=h) as s:
                for i in range(8):
                    body = {"prompt": "hello there " * (10 + i), "max_tokens": 64,
                            "sim_output_tokens": 12, "stream": True,
                            "stream_options": {"include_usage": True}}
                    async with s.post(stack.url + "/v1/completions", json=body) as r:
                        await r.read()
                        out.append(r.status)
            return out

        assert asyncio.run(send()) == [200] * 8
        # The observing filter sends without waiting: the last ends may still be on the way.
        deadline = time.monotonic() + 10.0
        while True:
            with urllib.request.urlopen(stack.epp_metrics + "/debug/endpoints", timeout=5) as r:
                slo = json.loads(r.read())["slo"]
            if slo["tpot"]["samples"] == 8 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        route_stack.stop(stack)
    assert slo["ttft"]["samples"] == 8 and slo["tpot"]["samples"] == 8
    assert slo["output_len"]["samples"] == 8 and slo["slo_requests"]["standard"] == 8
    assert slo["in_flight"] == 0
    # After three answers of 12 tokens the tenant's history predicts 12, not max_tokens.
    assert slo["output_len"]["mae"] < slo["output_len"]["mae_baseline"]


def test_held_out_errors_are_those_of_the_later_predictions() -> None:
    from kvyard.bench.slo_cpu import held_out

    before = {"ttft": {"samples": 10, "mape": 1.0, "p90_coverage": 0.5},
              "tpot": {"samples": 0, "mape": None, "p90_coverage": None},
              "output_len": {"samples": 10, "mae": 50.0, "mae_baseline": 100.0}}
    after = {"ttft": {"samples": 30, "mape": 0.5, "p90_coverage": 0.8},
             "tpot": {"samples": 20, "mape": 0.1, "p90_coverage": 0.9},
             "output_len": {"samples": 30, "mae": 20.0, "mae_baseline": 100.0}}
    h = held_out(before, after)
    assert h["ttft"] == {"samples": 20, "mape": 0.25, "p90_coverage": 0.95}
    assert h["tpot"]["samples"] == 20 and abs(h["tpot"]["mape"] - 0.1) < 1e-12
    assert h["output_len"] == {"samples": 20, "mae": 5.0, "mae_baseline": 100.0}
