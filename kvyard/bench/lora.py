"""`kvyard bench lora` (table + `--json`, `--quick`): many LoRA adapters, two halves.

Routing (`lora_route`): 16 simulated pods, 64 adapters, `--max-loras 4`, Zipf
popularity: adapter loads (thrash), adapter hit rate, prefix hit rate and TTFT p90 for
`lora-affinity + prefix` vs `prefix` alone vs `random`, each on a fresh pool, same
requests. Target: >= 3x fewer adapter loads and a better TTFT p90 than prefix alone.

Engine (`kvyard.bench.lora_engine.measure(quick)`, when the build has it): throughput and
TPOT with 1, 4 and 16 adapters in the batch vs the base model, adapter load time.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import tempfile
from pathlib import Path

QUICK = {"requests": 500, "rate": 40.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvyard.bench.lora_route import LoraWorkload

    d = LoraWorkload()
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer requests (same pool and keys)")
    g = p.add_argument_group("routing (simulated pods)")
    g.add_argument("--pods", type=int, default=d.pods)
    g.add_argument("--adapters", type=int, default=d.adapters)
    g.add_argument("--max-loras", type=int, default=d.max_loras)
    g.add_argument("--lora-load-time", default=d.load_time,
                   help="simulated cost of one adapter load (kvyard/sim/lora.py's default)")
    g.add_argument("--requests", type=int, default=d.requests)
    g.add_argument("--rate", type=float, default=d.rate, help="requests/s, Poisson")
    g.add_argument("--zipf", type=float, default=d.zipf_s, help="popularity exponent")
    g.add_argument("--output-tokens", type=int, default=d.output_tokens)
    g.add_argument("--profile", default=d.profile)
    g.add_argument("--time-scale", type=float, default=1.0)
    g.add_argument("--lora-weight", type=float, default=4.0,
                   help="lora-affinity's weight in the lora-affinity + prefix policy")
    g.add_argument("--policies", nargs="*", default=None,
                   help="lora-affinity+prefix, prefix, random (default: all)")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-engine", action="store_true", help="the routing half only")
    p.add_argument("--no-routing", action="store_true", help="the engine half only")
    p.add_argument("--run-dir", default=None, help="keep the pods' and the EPP's logs here")


def engine_half(quick: bool) -> dict:
    """`lora_engine.measure(quick)` when the build has it, else why not."""
    if importlib.util.find_spec("kvyard.bench.lora_engine") is None:
        return {"unavailable": "kvyard.bench.lora_engine is not in this build (LoRA in the "
                               "engine)"}
    return importlib.import_module("kvyard.bench.lora_engine").measure(quick)


def run(args: argparse.Namespace) -> int:
    from kvyard.bench import lora_route
    from kvyard.bench.report import Report

    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    w = lora_route.LoraWorkload(pods=args.pods, adapters=args.adapters, max_loras=args.max_loras,
                                load_time=args.lora_load_time, requests=args.requests,
                                rate=args.rate, zipf_s=args.zipf, output_tokens=args.output_tokens,
                                profile=args.profile, seed=args.seed)
    rep = Report("kvyard bench lora: routing on simulated pods (TTFT in simulated seconds)",
                 ["policy", "requests", "errors", "adapter_loads", "adapter_hit_rate",
                  "prefix_hit_rate", "imbalance", "ttft_p50", "ttft_p90"])
    rep.meta.update(workload={k: getattr(w, k) for k in w.__slots__},
                    lora_weight=args.lora_weight, time_scale=args.time_scale)
    if not args.no_routing:
        root = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="bench-lora-"))
        for row in lora_route.measure(w, root, args.lora_weight, args.time_scale,
                                      only=args.policies):
            rep.add(**row)
        rep.notes += lora_route.verdict(rep.rows)
    if not args.no_engine:
        eng = engine_half(args.quick)
        rep.meta["engine"] = eng
        rep.notes.append("engine: " + json.dumps(eng, default=str)[:2000])
    rep.emit(args.json)
    return 0
