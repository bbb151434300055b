"""`kvyard bench spec`: speculative decoding against none, same engine, same run, per workload.

Workloads (prompts ship in kvyard/bench/data/spec/): code (edit a source file and print
it), repetitive (quote a given document), factual QA, creative writing. Modes: n-gram
prompt lookup and a draft model (the demo's first `--draft-layers` layers: a
layer-truncated copy sharing its weights), each with `policy: always` (draft whenever
there is something to draft) and `auto` (pause a request whose drafts are mostly
rejected). Concurrency 1 and 8, greedy, the demo model in float32 on the CPU.

The machine is shared, so the modes run in paired rounds: within a round every mode of a
(workload, concurrency) runs back to back, in an order that alternates by round, and
each mode's speedup is the median over rounds of its tok/s over the same round's
no-speculation tok/s. Every mode's greedy tokens are checked against no speculation's.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from kvyard.bench.report import Report
from kvyard.bench.spec_run import (WORKLOADS, batch_prompts, load_prompts, make_engine, measure,
                                   mode_configs, paired)

COLUMNS = ["workload", "c", "mode", "tok_s", "tpot_ms", "speedup", "accept", "mean_len", "per_pos",
           "same_tokens"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--modes", default="none,ngram,ngram-auto,draft,draft-auto",
                   help="comma-separated: none, ngram, ngram-auto, draft, draft-auto")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds; speedups are their median")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts-c1", type=int, default=3, help="prompts a workload runs at concurrency 1")
    p.add_argument("--draft-layers", type=int, default=10, help="the draft model's decoder layers")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--quick", action="store_true",
                   help="a functional check: 1 round, 48 tokens, n-gram modes only")
    p.add_argument("--json", action="store_true")


def run(a: argparse.Namespace) -> int:
    import torch

    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.model import load_model

    if a.quick:
        a.rounds, a.max_tokens, a.prompts_c1 = 1, 48, 2
        if a.modes == "none,ngram,ngram-auto,draft,draft-auto":
            a.modes = "none,ngram,ngram-auto"
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    configs = mode_configs(a.draft_layers)
    unknown = [m for m in modes if m not in configs]
    if unknown or "none" not in modes:
        print(f"--modes must include none and only {', '.join(configs)}", file=sys.stderr)
        return 2
    conc = [int(c) for c in a.concurrency.split(",")]
    tok = load_tokenizer("demo")
    model, cfg = load_model(resolve_model("demo"), torch.float32)
    loaded = (model, cfg, tok)
    engines = {m: make_engine(loaded, configs[m], kv_cache_memory_bytes=128 << 20, max_model_len=2048,
                              max_num_seqs=max(conc)) for m in modes}
    report = Report(f"kvyard bench spec: demo model, float32, CPU ({torch.get_num_threads()} threads), "
                    f"greedy, {a.max_tokens} tokens, {a.rounds} paired round(s)", COLUMNS)
    for w in [w.strip() for w in a.workloads.split(",")]:
        prompts = load_prompts(tok, w)
        for c in conc:
            ps = batch_prompts(prompts, c, a.prompts_c1)
            measure(engines["none"], ps[:1], 1, 4)       # warm-up: kernels and caches
            rows = paired(engines, modes, ps, c, a.max_tokens, a.rounds)
            for m in modes:
                r = dict(rows[m])
                r["accept"] = r.pop("acceptance")
                r["per_pos"] = "/".join(f"{x:.2f}" for x in r["per_pos"]) if r["per_pos"] else None
                report.add(workload=w, c=c, mode=m, **r)
            print(f"# {w} c{c}: " + ", ".join(f"{m} {rows[m]['speedup']:.2f}x ({rows[m]['tok_s']} tok/s, "
                                                f"accept {rows[m]['acceptance']})" for m in modes),
                  file=sys.stderr, flush=True)
    _verdicts(report)
    report.meta.update(modes={m: configs[m] for m in modes}, draft_layers=a.draft_layers,
                       note="numbers under load from other processes on a shared machine")
    report.emit(a.json)
    return 0


def _verdicts(report: Report) -> None:
    rows = report.rows
    for w in ("repetitive", "code"):
        r = next((x for x in rows if x["workload"] == w and x["c"] == 1 and x["mode"] == "ngram"), None)
        if r is not None:
            report.notes.append(f"target c1 {w} ngram >= 1.5x: {r['speedup']:.2f}x "
                                f"({'met' if r['speedup'] >= 1.5 else 'missed'})")
    autos = [x for x in rows if x["mode"].endswith("-auto")]
    if autos:
        worst = min(autos, key=lambda x: x["speedup"])
        report.notes.append(f"target auto >= 0.95x everywhere: worst {worst['speedup']:.2f}x "
                            f"({worst['mode']}, {worst['workload']} c{worst['c']}; "
                            f"{'met' if worst['speedup'] >= 0.95 else 'missed'})")
    losing = [f"{x['mode']} {x['workload']} c{x['c']} {x['speedup']:.2f}x" for x in rows
              if x["mode"] != "none" and x["speedup"] < 0.95]
    report.notes.append("modes losing speed: " + ("; ".join(losing) if losing else "none"))
    if not all(x["same_tokens"] for x in rows):
        report.notes.append("WARNING: some mode's greedy tokens differ from no speculation")
