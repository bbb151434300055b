"""`kvyard bench route`: routing policies and peer routers on the same pods, same run.

Targets, each on a fresh pool of pods (cold caches) and the same requests:
kvyard's EPP policies through Envoy (`route_policies`: random, round_robin, load,
approx_prefix, precise_prefix, precise_prefix with 2 and 4 active-active EPP replicas
as `kvyard up --epp-replicas N` runs them) and the peer routers in front of the same
pods (`route_peers`: `smg:cache_aware`, `vllm-router:cache_aware`,
`vllm-router:kv_aware`; absent ones are "not installed").

Workload (`route_workload`): G shared-prefix groups x a P-token prefix x U users x
Q-token questions (llm-d's shape by default: 150 x 6k x 5 x 1.2k), Poisson or bursty
arrivals over a rate ladder; or `--trace FILE`, a Mooncake JSONL or Azure CSV trace
(`--trace synthetic`: the small Mooncake-format one shipped with kvyard).

Per target and rate: throughput (output tok/s), goodput (requests/s within the TTFT
and TPOT SLO), TTFT p50/p90/p99, TPOT p99, errors, sheds (429/503), the pool's
prefix-cache hit rate (pods' vLLM counters) next to the ideal infinite cache's on
the same requests, and load imbalance (max/mean requests per pod). A policy's
headline numbers are its top rung's; `by_rate` has every rung. `epp_cost`: the
EPP's idle CPU and decision latency/index memory from 8 to 256 pods, and its
CPU-seconds per request in the policy runs. Times are seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).parent / "data"
SYNTHETIC_TRACE = DATA / "route_mooncake_synthetic.jsonl"
# Ten targets, each on a fresh pool: rungs of 4 s keep the whole run near two and a half
# minutes on an idle 2-core box.
QUICK = {"pods": 8, "groups": 16, "prefix_tokens": 1000, "users": 4, "question_tokens": 200,
         "output_tokens": 32, "rates": [4.0, 8.0], "duration": 4.0, "cost_pods": [8, 64],
         "cost_iterations": 20, "cost_watch": 1.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="a reduced 8-pod experiment (minutes, same keys)")
    g = p.add_argument_group("pods")
    g.add_argument("--pods", type=int, default=8)
    g.add_argument("--backend", choices=("sim", "standin"), default=None,
                   help="simulated pods (default when available) or stand-ins")
    g.add_argument("--profile", default="h100", help="the simulator's latency profile")
    g.add_argument("--cache-ratio", type=float, default=0.73,
                   help="the workload's distinct prompt tokens / the pool's KV capacity: "
                        "sizes each simulated pod's cache (llm-d's experiment: ~0.73)")
    g.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks per simulated pod (instead of --cache-ratio)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="the simulator's simulated seconds per wall second")
    g = p.add_argument_group("workload (shared-prefix groups)")
    g.add_argument("--groups", type=int, default=150)
    g.add_argument("--prefix-tokens", type=int, default=6000)
    g.add_argument("--users", type=int, default=5)
    g.add_argument("--question-tokens", type=int, default=1200)
    g.add_argument("--output-tokens", type=int, default=1000)
    g.add_argument("--turns", type=int, default=1, help="> 1: multi-turn conversations")
    g.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 6.0, 8.0, 10.0])
    g.add_argument("--duration", type=float, default=60.0, help="seconds per rung")
    g.add_argument("--burstiness", type=float, default=1.0, help="1 Poisson, < 1 bursty")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trace", default=None,
                   help="replay a Mooncake .jsonl or Azure .csv trace instead ('synthetic': "
                        "the shipped Mooncake-format one)")
    g.add_argument("--trace-speedup", type=float, default=1.0)
    g.add_argument("--trace-limit", type=int, default=None)
    g = p.add_argument_group("targets and SLO")
    g.add_argument("--policies", nargs="*", default=None, help="EPP policies (default: all)")
    g.add_argument("--peers", nargs="*", default=None,
                   help="peer routers (default: all; none: --peers with no names)")
    g.add_argument("--install-peers", action="store_true",
                   help="pip install smg and vllm-router into .peers/ first")
    g.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    g.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    g.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    g = p.add_argument_group("EPP cost")
    g.add_argument("--cost-pods", type=int, nargs="*", default=[8, 32, 64, 128, 256])
    g.add_argument("--cost-iterations", type=int, default=200)
    g.add_argument("--cost-watch", type=float, default=5.0, help="idle seconds watched")
    p.add_argument("--plot", default=None, help="write the TTFT p90 vs rate SVG here")
    p.add_argument("--run-dir", default=None, help="keep the pods' and routers' logs here")


def _apply_quick(args: argparse.Namespace) -> None:
    for k, v in QUICK.items():
        setattr(args, k, v)


def _backend(args: argparse.Namespace) -> str:
    if args.backend:
        return args.backend
    try:
        import kvyard.sim  # noqa: F401 - present once the simulator is part of the build
        return "sim"
    except ImportError:
        return "standin"


def build_workload(args: argparse.Namespace):
    from kvyard.bench.route_run import Workload
    from kvyard.bench.route_trace import IdealCache, demand_tokens, read_trace
    from kvyard.bench.route_workload import Ladder, SharedPrefix, Vocab, prompt_texts

    vocab = Vocab.demo()
    shape = None
    if args.trace:
        path = SYNTHETIC_TRACE if args.trace == "synthetic" else Path(args.trace)
        reqs = read_trace(path, args.trace_speedup, args.trace_limit)
        span = max((r.at_s for r in reqs), default=0.0)
        rates, rungs = [len(reqs) / span if span else math.inf], [reqs]
        desc = {"trace": str(path), "requests": len(reqs), "speedup": args.trace_speedup}
    else:
        shape = SharedPrefix(args.groups, args.prefix_tokens, args.users, args.question_tokens,
                             args.output_tokens, args.turns, seed=args.seed)
        ladder = Ladder(list(args.rates), args.duration, args.burstiness, args.seed)
        rates, rungs = list(args.rates), ladder.build(shape)
        desc = {"shared_prefix": {"groups": shape.groups, "prefix_tokens": shape.prefix_tokens,
                                  "users": shape.users, "question_tokens": shape.question_tokens,
                                  "output_tokens": shape.output_tokens, "turns": shape.turns},
                "rates": rates, "duration_s": args.duration, "burstiness": args.burstiness,
                "requests": sum(len(r) for r in rungs)}
    ideal = IdealCache(vocab.ids)
    work = Workload(rates, rungs, prompt_texts(rungs, vocab), [ideal.feed(r) for r in rungs])
    desc["cache_demand_tokens"] = demand_tokens(shape, [r for rung in rungs for r in rung])
    return work, desc


def pods_for(args: argparse.Namespace, work, desc: dict):
    """The pool: each simulated pod's cache sized so that the workload's distinct
    tokens are `--cache-ratio` of the pool's (unless `--kv-blocks` says)."""
    from kvyard.bench.route_stack import Pods
    from kvyard.bench.route_trace import ENGINE_BLOCK

    longest = max((r.prompt_tokens + r.output_tokens for rung in work.rungs for r in rung),
                  default=0)
    pods = Pods(_backend(args), args.pods, args.profile, args.kv_blocks,
                max(8192, longest + 64), args.seed, args.time_scale)
    if pods.backend == "sim":
        if pods.kv_blocks is None:
            # Never below room for a few of the longest requests at once (a tiny workload).
            pods.kv_blocks = max(4 * math.ceil(longest / ENGINE_BLOCK), 256,
                                 math.ceil(desc["cache_demand_tokens"] / args.cache_ratio
                                           / args.pods / ENGINE_BLOCK))
        capacity = pods.kv_blocks * ENGINE_BLOCK * args.pods
        desc["pool_capacity_tokens"] = capacity
        desc["cache_demand_ratio"] = desc["cache_demand_tokens"] / capacity
    return pods


def run(args: argparse.Namespace) -> int:
    from kvyard.bench import route_cost, route_peers
    from kvyard.bench.route_metrics import KEYS, Slo
    from kvyard.bench.route_policies import select
    from kvyard.bench.route_run import run_target

    if args.quick:
        _apply_quick(args)
    if args.install_peers:
        route_peers.install(["smg", "vllm-router"])
    t0 = time.monotonic()
    work, desc = build_workload(args)
    pods = pods_for(args, work, desc)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    peers = [p for p in route_peers.PEERS if args.peers is None or p.name in args.peers]
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="kvyard-bench-route-"))
    results = {}
    targets = [(p.name, {"policy": p}) for p in select(args.policies)]
    targets += [(p.name, {"peer": p}) for p in peers]
    for name, kind in targets:
        try:
            results[name] = run_target(name, pods, work, run_root, args.timeout,
                                       **kind).summary(slo)
        except Exception as e:  # noqa: BLE001 - one target's failure is its row, not the run's
            results[name] = {"unavailable": f"failed: {str(e)[-300:]}", "errors": 1}
    cost = route_cost.epp_cost(args.cost_pods, args.cost_iterations, args.cost_watch)
    per_req = {n: r["epp_cpu_s_per_req"] for n, r in results.items()
               if "epp_cpu_s_per_req" in r and not math.isnan(r["epp_cpu_s_per_req"])}
    cost["cpu_s_per_request"] = per_req
    config = {"pods": args.pods, "backend": pods.backend, "profile": args.profile,
              "kv_blocks_per_pod": pods.kv_blocks,
              "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "quick": args.quick,
              "run_dir": str(run_root), "wall_s": None, **desc}
    config["wall_s"] = time.monotonic() - t0
    doc = {"config": config, "policies": results, "epp_cost": cost}
    if args.plot:
        from kvyard.bench.route_plot import write_ttft_plot

        write_ttft_plot(results, Path(args.plot),
                        f"TTFT p90 vs rate, {args.pods} {pods.backend} pods")
    if args.json:
        print(json.dumps(_finite(doc), indent=1))
    else:
        print(table(doc, KEYS))
    return 0 if all(r.get("errors", 0) == 0 for r in results.values()) else 1


def _finite(o):
    """NaN (no data, e.g. no successful request) as null: strict JSON."""
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


def table(doc: dict, keys: tuple[str, ...]) -> str:
    from kvyard.bench.report import Report

    rep = Report(title=f"kvyard bench route ({doc['config']['pods']} "
                       f"{doc['config']['backend']} pods)",
                 columns=["policy", "rate", *keys])
    for name, r in doc["policies"].items():
        if "unavailable" in r:
            rep.notes.append(f"{name}: {r['unavailable']}")
            continue
        for row in r["by_rate"]:
            rep.add(policy=name, **{k: row.get(k) for k in ("rate", *keys)})
        rep.notes += [f"{name}: {n}" for n in r.get("notes", [])]
    c = doc["epp_cost"]
    for i, d in zip(c["idle"], c["decisions"]):
        rep.notes.append(f"EPP at {i['pods']} pods: idle {i['idle_cpu_cores']:.3f} cores, "
                         f"decision p50 {1000 * d['decision_p50']:.2f} ms p99 "
                         f"{1000 * d['decision_p99']:.2f} ms, index {d['index_mb']:.2f} MB "
                         f"after {d['requests']} requests")
    for n, v in c["cpu_s_per_request"].items():
        rep.notes.append(f"EPP CPU per request ({n}): {1000 * v:.2f} ms")
    return rep.table()
