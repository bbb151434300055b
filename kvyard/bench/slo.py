"""`kvyard bench slo`: SLO-aware routing and admission on simulated pods, and reactive vs
predictive autoscaling (`slo_autoscale`).

Pods: `kvyard sim serve` (h100 profile, 16 pods) behind Envoy and the EPP, a fresh pool
per policy (`route_stack`); for the latency policies the gateway's observing filter
streams the responses to the EPP so its predictors learn (`observe_responses`).
`--time-scale` slows the simulator (simulated seconds per wall second) so a 2-core
machine can drive the pool past saturation; every time reported is simulated seconds,
SLOs included (the headers carry them in wall milliseconds).
Workload: `route_workload`'s shared-prefix groups as multi-turn conversations
(`--turns`), each group a tenant (fairness id) with its own natural output length
(`sim_output_tokens`; max_tokens is a fixed cap, the output-length baseline), a third of
the tenants batch (sheddable, priority -1, TTFT <= 1 s, TPOT <= 100 ms) and the rest
interactive (TTFT <= 0.5 s, TPOT <= 50 ms), over a rate ladder (simulated req/s).
Policies: load, precise_prefix, precise_prefix+latency, +admission (= precise_prefix
+latency with SLO admission). Per policy, the top rung: goodput (requests/s within their
class's SLO), attainment per class, TTFT/TPOT p50/p90/p99, sheds, errors, the pods'
prefix-hit rate (conversation affinity). Predictor: MAPE and p90 coverage of the last
latency policy's EPP on the requests after the first rung (each predicted before its
own outcome was learned), and output-length MAE vs max_tokens. `--repeat N` runs every
policy N times, paired, and reports medians with min/max (`slo_repeat`); `cpu_workers`: the same
on a real CPU worker (`slo_cpu`). `epp_cost`: decision latency with and without the
latency scorer, paired (`slo_cost`), and the EPP's CPU per request per policy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

QUICK = {"rates": [50.0, 150.0], "duration": 5.0, "groups": 24, "cpu_requests": 6}
CLASSES = {"interactive": (500, 50, "0"), "batch": (1000, 100, "-1")}  # ttft ms, tpot ms, prio
MAX_TOKENS = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="a reduced run (< 3 minutes)")
    p.add_argument("--pods", type=int, default=16)
    p.add_argument("--profile", default="h100")
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--time-scale", type=float, default=0.25,
                   help="simulated seconds per wall second (< 1: a slower pool for a busy box)")
    p.add_argument("--groups", type=int, default=48)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--question-tokens", type=int, default=200)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rates", type=float, nargs="+", default=[40.0, 80.0, 120.0, 160.0, 200.0])
    p.add_argument("--duration", type=float, default=12.0, help="wall seconds per rung")
    p.add_argument("--cpu-requests", type=int, default=24,
                   help="held-out requests on a real CPU worker (0: skip that run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pod-start", type=float, default=None,
                   help="autoscale: simulated pod start seconds (default 60 on the stack, "
                        "30 in the fluid model)")
    from kvyard.bench.slo_autoscale_cli import add_arguments as autoscale_arguments

    autoscale_arguments(p)
    p.add_argument("--plot", default="docs/bench/slo-goodput.svg")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--policies", nargs="+", default=None, choices=list(_policies()),
                   help="run only these policies (default: all four)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every policy N times, paired (each repeat runs all policies on "
                        "the same requests back to back); report medians and min/max")


@dataclass(slots=True)
class Tagged:
    cls: str
    tenant: int
    natural: int


def _policies() -> dict[str, list[dict]]:
    from kvyard.bench.route_policies import LOAD

    precise = [{"type": "precise-prefix-cache", "weight": 3}, *LOAD]
    lat = {"type": "latency", "weight": 4, "minSamples": 20}
    return {"load": list(LOAD), "precise_prefix": precise,
            "precise_prefix+latency": [*precise, lat],
            "+admission": [*precise, {**lat, "admission": True}]}


def _tags(rungs, seed: int) -> list[list[Tagged]]:
    rng = random.Random(seed)
    natural = {}
    out = []
    for rung in rungs:
        row = []
        for r in rung:
            g = r.group
            if g not in natural:  # each tenant's typical answer length
                natural[g] = int(rng.uniform(4, 32))
            n = max(2, min(MAX_TOKENS, int(rng.gauss(natural[g], natural[g] * 0.15))))
            row.append(Tagged("batch" if g % 3 == 0 else "interactive", g, n))
        out.append(row)
    return out


async def _replay(url: str, reqs, texts, tags, scale: float):
    import aiohttp

    from kvyard.bench.client import completion_body, stream
    from kvyard.bench.slo_cpu import WithHeaders

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(r, text, tag):
            delay = t0 + r.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            ttft, tpot, prio = CLASSES[tag.cls]
            h = {"x-llm-d-slo-ttft-ms": f"{ttft / scale:g}", "x-llm-d-slo-tpot-ms":
                 f"{tpot / scale:g}", "x-llm-d-inference-objective": prio,
                 "x-llm-d-inference-fairness-id": f"tenant-{tag.tenant}"}
            body = completion_body(None, text, MAX_TOKENS)
            body["sim_output_tokens"] = tag.natural
            return await stream(WithHeaders(s, h), url, body)

        res = await asyncio.gather(*(one(r, x, g) for r, x, g in zip(reqs, texts, tags)))
        return res, loop.time() - t0


def _pct(xs: list[float], q: float) -> float:
    from kvyard.bench.report import percentile

    return percentile(xs, q) if xs else math.nan


def _rung(rate: float, results, tags, wall: float, scale: float, hit: float) -> dict:
    ok = [(r, t) for r, t in zip(results, tags) if r.ok]
    shed = sum(1 for r in results if r.error and r.error.startswith(("HTTP 429", "HTTP 503")))
    met = {c: 0 for c in CLASSES}
    total = {c: 0 for c in CLASSES}
    for r, t in zip(results, tags):
        total[t.cls] += 1
        ttft, tpot, _ = CLASSES[t.cls]
        if r.ok and r.ttft_s * scale <= ttft / 1000 and (
                math.isnan(r.tpot_s) or r.tpot_s * scale <= tpot / 1000):
            met[t.cls] += 1
    ttft = [r.ttft_s * scale for r, _ in ok]
    tpot = [r.tpot_s * scale for r, _ in ok if not math.isnan(r.tpot_s)]
    return {"rate": rate, "goodput": sum(met.values()) / (wall * scale),
            "attainment": {c: met[c] / total[c] if total[c] else math.nan for c in CLASSES},
            "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "ttft_p99": _pct(ttft, 99),
            "tpot_p50": _pct(tpot, 50), "tpot_p90": _pct(tpot, 90), "tpot_p99": _pct(tpot, 99),
            "shed": shed, "errors": len(results) - len(ok) - shed, "hit_rate": hit,
            "requests": len(results)}


def run_policy(name: str, scorers: list[dict], pods, work, tags, run_root: Path, scale: float
               ) -> tuple[list[dict], dict]:
    """Every rung on a fresh pool; the EPP's SLO snapshot after the first rung and at the
    end (`held_out`: the predictions of the later rungs, the first one warming up)."""
    from kvyard.bench import route_stack
    from kvyard.bench.route_metrics import pool_delta, scrape
    from kvyard.bench.route_policies import Policy
    from kvyard.bench.slo_cpu import held_out, snapshot
    from kvyard.stack import procs

    run = run_root / name.replace("+", "plus-")
    run.mkdir(parents=True, exist_ok=True)
    observe = any(s["type"] == "latency" for s in scorers)
    stack = route_stack.start(pods, run, Policy(name, scorers).write(run),
                              observe_responses=observe)
    rows, snaps = [], []
    cpu0, sent = procs.cpu_seconds(stack.epps[0].pid), 0
    try:
        for rate, reqs, texts, tg in zip(work.rates, work.rungs, work.texts, tags):
            before = asyncio.run(scrape(stack.addresses))
            res, wall = asyncio.run(_replay(stack.url, reqs, texts, tg, scale))
            after = asyncio.run(scrape(stack.addresses))
            rows.append(_rung(rate, res, tg, wall, scale, pool_delta(before, after)[0]))
            sent += len(reqs)
            snaps.append(snapshot(stack) if observe else {})
        cpu = (procs.cpu_seconds(stack.epps[0].pid) - cpu0) / max(1, sent)
    finally:
        route_stack.stop(stack)
    slo = held_out(snaps[0], snaps[-1]) if len(snaps) > 1 else (snaps[0] if snaps else {})
    slo["epp_cpu_s_per_req"] = cpu
    (run / "result.json").write_text(json.dumps({"rows": rows, "slo": slo}))
    return rows, slo


def run(args: argparse.Namespace) -> int:
    from kvyard.bench.route import _finite, build_workload
    from kvyard.bench.route_stack import Pods
    from kvyard.bench import slo_autoscale_cli
    from kvyard.bench.slo_cost import epp_cost
    from kvyard.bench.slo_repeat import _median, merge_policy, merge_predictor

    if args.only == "autoscale":
        return slo_autoscale_cli.run_only(args)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    t0 = time.monotonic()
    scale = args.time_scale
    wargs = argparse.Namespace(trace=None, groups=args.groups, prefix_tokens=args.prefix_tokens,
                               users=args.users, question_tokens=args.question_tokens,
                               output_tokens=MAX_TOKENS, turns=args.turns,
                               rates=[r * scale for r in args.rates], duration=args.duration,
                               burstiness=1.0, seed=args.seed)
    work, desc = build_workload(wargs)
    work.rates = list(args.rates)
    tags = _tags(work.rungs, args.seed)
    pods = Pods("sim", args.pods, args.profile, args.kv_blocks, 8192, args.seed, scale)
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="kvyard-bench-slo-"))
    policies, by_rate, cpu = {}, {}, {}
    chosen = {n: s for n, s in _policies().items() if not args.policies or n in args.policies}
    runs: dict[str, list[list[dict]]] = {name: [] for name in chosen}
    snaps: list[dict] = []
    for rep in range(max(1, args.repeat)):
        pred = {}
        for name, scorers in chosen.items():
            sub = root / f"repeat-{rep}" if args.repeat > 1 else root
            rows, slo = run_policy(name, scorers, pods, work, tags, sub, scale)
            runs[name].append(rows)
            cpu.setdefault(name, []).append(slo.get("epp_cpu_s_per_req"))
            if slo.get("ttft", {}).get("samples"):
                pred = slo
        snaps.append(pred)
    for name, reps in runs.items():
        rows = by_rate[name] = merge_policy(reps) if len(reps) > 1 else reps[0]
        cpu[name] = _median(cpu[name])
        top = rows[-1]
        policies[name] = {"goodput": top["goodput"], "attainment": top["attainment"],
                          "ttft_p90": top["ttft_p90"], "tpot_p90": top["tpot_p90"],
                          "shed": top["shed"], "errors": top["errors"]}
        if len(reps) > 1:
            policies[name].update({k: top[k] for k in top if k.endswith(("_min", "_max"))})
    pred = merge_predictor(snaps) if len(snaps) > 1 else snaps[0]
    ol = pred.get("output_len", {})
    ttft_cov, tpot_cov = (pred.get(k, {}).get("p90_coverage") for k in ("ttft", "tpot"))
    predictor = {"ttft_mape": pred.get("ttft", {}).get("mape"),
                 "tpot_mape": pred.get("tpot", {}).get("mape"),
                 "p90_coverage": None if ttft_cov is None else (ttft_cov + (tpot_cov or 0)) / 2,
                 "ttft_p90_coverage": ttft_cov, "tpot_p90_coverage": tpot_cov,
                 "samples": pred.get("ttft", {}).get("samples"),
                 "output_len_mae": ol.get("mae"), "output_len_mae_baseline": ol.get("mae_baseline")}
    auto = slo_autoscale_cli.section(args, root)
    cost = epp_cost([16, 64], 100 if args.quick else 400)
    cpu_run = None
    if args.cpu_requests:
        from kvyard.bench.slo_cpu import run_cpu

        cpu_run = run_cpu(1, args.cpu_requests, 4 if args.quick else 12, root / "cpu",
                          args.seed)
    cost["epp_cpu_s_per_request"] = cpu  # the latency policies with response observation
    doc = {"policies": policies, "predictor": predictor,
           "autoscale": slo_autoscale_cli.summary(auto),
           "by_rate": by_rate, "epp_cost": cost, "cpu_workers": cpu_run,
           "config": {"pods": args.pods, "profile": args.profile, "time_scale": scale,
                      "rates_sim_rps": args.rates, "rung_wall_s": args.duration,
                      "repeat": args.repeat,
                      "classes": CLASSES, "max_tokens": MAX_TOKENS, "quick": args.quick,
                      "autoscale_model": auto["model"], "autoscale_spare": auto.get("spare"),
                      "autoscale_detail": {m: auto[m] for m in ("reactive", "predictive")},
                      "run_dir": str(root),
                      "requests": desc.get("requests"), "wall_s": time.monotonic() - t0}}
    if args.plot:
        from kvyard.bench.route_plot import svg

        path = Path(args.plot)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(svg({n: [(r["rate"], r["goodput"]) for r in rows]
                             for n, rows in by_rate.items()},
                            f"goodput vs rate, {args.pods} simulated {args.profile} pods",
                            "request rate (simulated req/s)", "goodput (req/s within SLO)"))
    if args.json:
        print(json.dumps(_finite(doc), indent=1))
    else:
        print(_table(doc))
    return 0


def _table(doc: dict) -> str:
    from kvyard.bench.report import Report
    from kvyard.bench.route import _finite

    repeat = doc["config"].get("repeat", 1)
    spread = ["goodput_range", "att_interactive_range"] if repeat > 1 else []
    rep = Report(title="kvyard bench slo (simulated seconds" +
                 (f"; medians of {repeat} paired repeats, min-max)" if repeat > 1 else ")"),
                 columns=["policy", "rate", "goodput", *spread[:1], "att_interactive",
                          *spread[1:], "att_batch", "ttft_p50", "ttft_p90", "ttft_p99",
                          "tpot_p90", "hit_rate", "shed", "errors"])
    for name, rows in doc["by_rate"].items():
        for r in rows:
            ranges = {k: f"{r[k + '_min']:.1f}-{r[k + '_max']:.1f}" if k == "goodput" else
                      f"{r[k + '_min']:.2f}-{r[k + '_max']:.2f}"
                      for k in ("goodput", "att_interactive") if k + "_min" in r}
            rep.add(policy=name, rate=r["rate"], goodput=r["goodput"],
                    **{k + "_range": v for k, v in ranges.items()},
                    att_interactive=r["attainment"]["interactive"],
                    att_batch=r["attainment"]["batch"], ttft_p50=r["ttft_p50"],
                    ttft_p90=r["ttft_p90"], ttft_p99=r["ttft_p99"], tpot_p90=r["tpot_p90"],
                    hit_rate=r["hit_rate"], shed=r["shed"], errors=r["errors"])
    rep.notes.append(f"predictor: {json.dumps(_finite(doc['predictor']))}")
    rep.notes.append(f"autoscale: {json.dumps(_finite(doc['autoscale']))}")
    rep.notes.append(f"EPP cost: {json.dumps(_finite(doc['epp_cost']))}")
    rep.notes.append(f"CPU workers: {json.dumps(_finite(doc['cpu_workers']))}")
    return rep.table()
