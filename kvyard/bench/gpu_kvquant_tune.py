"""Tuning run for the quantized-KV decode kernels (workers/attention/triton_decode_quant_fast.py).

On the GPU host: `python3 -m kvyard.bench.gpu_kvquant_tune --out FILE.json [--budget-s 185]`
(`bash tools/device_gpu.sh module gpu_kvquant_tune`; docs/gpu-notes.md). For the 8B attention
shape (gpu_kvquant.py's caches, tables and q) at each (batch, context) of SHAPES and each format,
every variant x a tile grid (BLOCK_N x warps x stages) is timed as CUDA-graph replays
(gpu_kernels._time_ms), and so is the bf16 kernel over the same grid. Each result is checked
against the bf16 kernel's output on the same data (relative error); a variant more than 2x the
"words" variant's error is rejected. Kernels compile first on a thread pool (Triton releases the
GIL while it compiles); trials run in order of a prior over tiles (likely tiles first for every
shape, format and variant), and when the time budget runs out the rest are skipped and counted.

The JSON: per shape and format the best (variant, tile, ms, gbps, per-byte ratio vs bf16's best
tile) and each variant's best; the bf16 best tile per shape; per format a summary
(`best_variant`, `best_config_by_shape`, `attn_throughput_per_byte_vs_bf16` as a geomean) and
`suggested_defaults` in the shape of triton_decode_quant_fast.DEFAULTS (paste it there).
`select` is the pure part (tested on fake timings: tests/bench/test_gpu_kvquant_tune.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, Callable

from kvyard.bench.gpu_kernels import _geomean
from kvyard.bench.gpu_kvquant import BS, HD, NH, NKV, build, kv_bytes, quantized

SHAPES = [(1, 32768), (8, 4096), (64, 1024), (128, 1024)]
FORMATS = ["fp8", "int8"]
VARIANTS = ["words", "win", "asm", "bytes", "bytes_t"]   # words first (the error baseline), then by static promise
BLOCK_NS, WARPS, STAGES = (64, 128, 32), (4, 8, 2), (3, 2, 1)   # each in order of prior
ERR_FALLBACK = {"fp8": 0.08, "int8": 0.02}   # 2x the words kernel's error on an H200, if words fails
BF16_ERR = 0.01   # a bf16 tile against the bf16 default tile: rounding only


@dataclass(slots=True, frozen=True)
class Tile:
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(slots=True, frozen=True)
class Trial:
    shape: str       # "BxC"
    fmt: str         # fp8 | int8 | bf16 (the baseline kernel)
    variant: str     # a quantized variant, or "bf16"
    tile: Tile


def tiles() -> list[Tile]:
    """The grid in order of prior (rank sum over the three orders), less 8 warps on 32-key tiles
    (a 16 x 32 score tile is one MMA tile per warp at most)."""
    grid = [Tile(b, w, s) for b in BLOCK_NS for w in WARPS for s in STAGES if not (b == 32 and w == 8)]
    return sorted(grid, key=lambda t: (BLOCK_NS.index(t.block_n) // 2 + WARPS.index(t.num_warps)
                                       + STAGES.index(t.num_stages)))


def shape_key(B: int, ctx: int) -> str:
    return f"{B}x{ctx}"


def plan(shapes: list[str], fmts: list[str], variants: list[str], grid: list[Tile]) -> list[Trial]:
    """Every trial, tile-major: a budget cut drops the least likely tiles everywhere."""
    out = []
    for t in grid:
        for sh in shapes:
            out.append(Trial(sh, "bf16", "bf16", t))
            out += [Trial(sh, f, v, t) for f in fmts for v in variants]
    return out


def _best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return min(rows, key=lambda r: r["ms"], default=None)


def _tile_of(r: dict[str, Any]) -> dict[str, int]:
    return {k: r[k] for k in ("block_n", "num_warps", "num_stages")}


def select(results: list[dict[str, Any]], shapes: list[str], fmts: list[str], nbytes: dict[str, dict[str, int]],
           splits: dict[str, int]) -> dict[str, Any]:
    """Results (shape, fmt, variant, block_n, num_warps, num_stages, ms | None, rel_err | None,
    error | None) -> the report: bests per shape and format, per-format summary, suggested
    DEFAULTS. nbytes[shape][fmt or "bf16"]: bytes a step reads; splits[shape]: the launch's splits."""
    ok = [r for r in results if r.get("ms") is not None and r.get("error") is None]
    report: dict[str, Any] = {"shapes": {}, "bf16_best": {}, "rejected": 0}
    accepted: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for sh in shapes:
        bf = _best([r for r in ok if r["shape"] == sh and r["fmt"] == "bf16" and (r["rel_err"] or 0) < BF16_ERR])
        report["bf16_best"][sh] = bf and {**_tile_of(bf), "ms": bf["ms"],
                                          "gbps": round(nbytes[sh]["bf16"] / bf["ms"] / 1e6, 1)}
        report["shapes"][sh] = {"splits": splits[sh]}
        for f in fmts:
            rows = [r for r in ok if r["shape"] == sh and r["fmt"] == f]
            words = [r["rel_err"] for r in rows if r["variant"] == "words"]
            limit = 2 * min(words) if words else ERR_FALLBACK.get(f, 0.08)
            good = [r for r in rows if r["rel_err"] is not None and r["rel_err"] <= limit * 1.0001]
            report["rejected"] += len(rows) - len(good)
            accepted[(sh, f)] = good

            def entry(r: dict[str, Any]) -> dict[str, Any]:
                gbps = nbytes[sh][f] / r["ms"] / 1e6
                per_byte = gbps / (nbytes[sh]["bf16"] / bf["ms"] / 1e6) if bf else math.nan
                return {"variant": r["variant"], **_tile_of(r), "ms": r["ms"], "gbps": round(gbps, 1),
                        "per_byte_vs_bf16": round(per_byte, 3), "rel_err": r["rel_err"]}
            by_variant = {v: entry(b) for v in dict.fromkeys(r["variant"] for r in good)
                          if (b := _best([r for r in good if r["variant"] == v]))}
            best = _best(good)
            report["shapes"][sh][f] = {"best": best and entry(best), "by_variant": by_variant,
                                       "err_limit": round(limit, 5)}
    report["summary"] = {f: _summary(report, shapes, f) for f in fmts}
    report["suggested_defaults"] = {f: _defaults(accepted, shapes, f, splits) for f in fmts}
    return report


def _summary(report: dict[str, Any], shapes: list[str], f: str) -> dict[str, Any]:
    """The variant with the best geomean over shapes of (its best ms / the shape's best ms),
    among variants with a result at every shape."""
    per = [report["shapes"][sh][f] for sh in shapes]
    variants = [v for v in dict.fromkeys(v for p in per for v in p["by_variant"])
                if all(v in p["by_variant"] for p in per)]
    score = {v: _geomean([p["by_variant"][v]["ms"] / p["best"]["ms"] for p in per]) for v in variants}
    by_variant = {v: round(_geomean([p["by_variant"][v]["per_byte_vs_bf16"] for p in per]), 3) for v in variants}
    if not score:
        return {"best_variant": None, "best_config_by_shape": {}, "attn_throughput_per_byte_vs_bf16": None,
                "per_byte_vs_bf16_by_variant": by_variant}
    v = min(score, key=score.get)
    return {"best_variant": v,
            "best_config_by_shape": {sh: p["by_variant"][v] for sh, p in zip(shapes, per)},
            "attn_throughput_per_byte_vs_bf16": by_variant[v],
            "per_byte_vs_bf16_by_variant": by_variant}


def _defaults(accepted: dict[tuple[str, str], list[dict[str, Any]]], shapes: list[str], f: str,
              splits: dict[str, int]) -> dict[str, Any]:
    """Per launch kind (split / unsplit): the (variant, tile) with the best geomean of ms over the
    kind's shapes relative to each shape's best, among those run at every one of them."""
    out: dict[str, Any] = {}
    for kind in ("split", "unsplit"):
        group = [sh for sh in shapes if (splits[sh] > 1) == (kind == "split")]
        if not group:
            continue
        times: dict[tuple, dict[str, float]] = {}
        for sh in group:
            for r in accepted[(sh, f)]:
                times.setdefault((r["variant"], *_tile_of(r).values()), {})[sh] = r["ms"]
        best_ms = {sh: min((t[sh] for t in times.values() if sh in t), default=math.nan) for sh in group}
        full = {k: _geomean([t[sh] / best_ms[sh] for sh in group]) for k, t in times.items() if len(t) == len(group)}
        if full:
            k = min(full, key=full.get)
            out[kind] = {"variant": k[0], "block_n": k[1], "num_warps": k[2], "num_stages": k[3],
                         "slowdown_vs_per_shape_best": round(full[k], 3)}
    return out


@dataclass(slots=True)
class _Case:
    """One shape's tensors: the bf16 cache and its quantized copies, shared by every trial."""

    caches: dict[str, Any]
    tables: Any
    lens: Any
    q: Any
    out: Any
    workspace: Any
    splits: int
    ref: Any = None


def _call(torch, case: _Case, trial: Trial) -> Callable[[], Any]:
    from kvyard.workers.attention.triton_decode import DecodeConfig, paged_decode

    t = trial.tile
    quant = {} if trial.variant == "bf16" else dict(quant_variant=trial.variant, quant_block_n=t.block_n,
                                                    quant_num_warps=t.num_warps, quant_num_stages=t.num_stages)
    cfg = DecodeConfig(case.splits, t.block_n, t.num_warps, t.num_stages, **quant)
    cache = case.caches[trial.fmt]
    return lambda: paged_decode(case.q, cache, case.tables, case.lens, HD ** -0.5, out=case.out, config=cfg,
                                workspace=case.workspace)


def _cases(torch, shapes: list[tuple[int, int]], fmts: list[str], dev: str, dtype: Any, sms: int) -> dict[str, _Case]:
    from kvyard.workers.attention.triton_decode import DecodeWorkspace, decode_config, paged_decode

    cases = {}
    for B, ctx in shapes:
        cache, tables, lens, q = build(torch, B, ctx, dev, dtype)
        cfg = decode_config(B, NKV, tables.shape[1] * BS, sms)
        ws = DecodeWorkspace.allocate(B, NH, HD, cfg.num_splits, dev) if cfg.num_splits > 1 else None
        case = _Case({"bf16": cache, **{f: quantized(torch, cache, f) for f in fmts}}, tables, lens, q,
                     torch.empty_like(q), ws, cfg.num_splits)
        case.ref = paged_decode(q, cache, tables, lens, HD ** -0.5, config=cfg, workspace=ws).float()
        cases[shape_key(B, ctx)] = case
    return cases


def _record(trial: Trial, **kw: Any) -> dict[str, Any]:
    return {"shape": trial.shape, "fmt": trial.fmt, "variant": trial.variant, **asdict(trial.tile),
            "ms": None, "rel_err": None, "error": None, **kw}


def _precompile(torch, trials: list[Trial], calls: dict[Trial, Callable[[], Any]], splits: dict[str, int],
                threads: int, budget_s: float, dev: str) -> float:
    """Run one trial per kernel (shapes with the same splits share every specialisation) on a
    thread pool, so that Triton compiles them in parallel; each variant's first serially (one-time
    set-up off the pool). Failures are only counted: the timed loop retries and records them."""
    t0 = time.monotonic()
    unique = list({(tr.variant, tr.fmt, tr.tile, splits[tr.shape]): tr for tr in reversed(trials)}.values())[::-1]
    failures = []

    def first(tr: Trial) -> None:
        try:
            calls[tr]()
        except Exception as e:
            failures.append(f"{tr.variant}/{tr.fmt}: {type(e).__name__}")
    heads = list({tr.variant: tr for tr in reversed(unique)}.values())
    for tr in heads:
        first(tr)
    with ThreadPoolExecutor(threads) as pool:
        futs = [pool.submit(first, tr) for tr in unique if tr not in heads]
        done, pending = wait(futs, timeout=max(1.0, budget_s - (time.monotonic() - t0)))
        for f in pending:
            f.cancel()
    if dev == "cuda":
        torch.cuda.synchronize()
    took = time.monotonic() - t0
    print(f"compiled {len(done) + len(heads)}/{len(unique)} kernels in {took:.0f} s; failed: {failures[:5]}",
          flush=True)
    return took


def run(torch, shapes: list[tuple[int, int]], fmts: list[str], variants: list[str], grid: list[Tile],
        budget_s: float, timer: Callable[[Callable[[], Any]], float], dev: str = "cuda", dtype: Any = None,
        threads: int = 0, sms: int = 132) -> dict[str, Any]:
    """Build the cases, compile on `threads` threads (0: none) for up to half the budget, time
    every trial with `timer` until the budget is spent, and report (`select`)."""
    t0 = time.monotonic()
    cases = _cases(torch, shapes, fmts, dev, dtype, sms)
    keys = [shape_key(*s) for s in shapes]
    trials = plan(keys, fmts, variants, grid)
    calls = {tr: _call(torch, cases[tr.shape], tr) for tr in trials}
    compile_s = 0.0
    if threads:
        compile_s = _precompile(torch, trials, calls, {k: c.splits for k, c in cases.items()}, threads,
                                budget_s / 2 - (time.monotonic() - t0), dev)
    results, skipped = [], 0
    for i, tr in enumerate(trials):
        if i and i % 200 == 0:
            print(f"{i}/{len(trials)} trials, {time.monotonic() - t0:.0f} s", flush=True)
        if time.monotonic() - t0 > budget_s:
            skipped += 1
            continue
        try:
            ms = timer(calls[tr])
            got = calls[tr]().float()
            ref = cases[tr.shape].ref
            results.append(_record(tr, ms=round(ms, 5), rel_err=round(float((got - ref).norm() / ref.norm()), 5)))
        except Exception as e:
            results.append(_record(tr, error=f"{type(e).__name__}: {str(e).strip()[:200]}"))
    if skipped:
        print(f"time budget of {budget_s:.0f} s spent: {skipped} of {len(trials)} trials skipped", flush=True)
    nbytes = {k: {f: kv_bytes(B, ctx, cases[k].q.numel(), f) for f in ["bf16", *fmts]}
              for k, (B, ctx) in zip(keys, shapes)}
    report = select(results, keys, fmts, nbytes, {k: cases[k].splits for k in keys})
    errors = {}
    for r in results:
        if r["error"]:
            errors.setdefault(f'{r["variant"]}/{r["fmt"]}', r["error"])
    report.update(trials=len(trials), skipped=skipped, compile_s=round(compile_s, 1),
                  total_s=round(time.monotonic() - t0, 1), errors=errors,
                  results=[[r["shape"], r["fmt"], r["variant"], r["block_n"], r["num_warps"], r["num_stages"],
                            r["ms"], r["rel_err"]] for r in results if r["ms"] is not None],
                  results_columns=["shape", "fmt", "variant", "block_n", "num_warps", "num_stages", "ms", "rel_err"])
    return report


def shape_lines(report: dict[str, Any], fmts: list[str]) -> list[str]:
    """One line per shape: the bf16 best, then each format's best and its per-byte ratio."""
    lines = []
    for sh, row in report["shapes"].items():
        bf = report["bf16_best"][sh]
        parts = [f"{sh} (splits {row['splits']}): bf16 " + (f"{bf['ms']:.4f} ms {bf['gbps']:.0f} GB/s "
                                                           f"[{bf['block_n']},{bf['num_warps']},{bf['num_stages']}]"
                                                           if bf else "-")]
        for f in fmts:
            b = row[f]["best"]
            parts.append(f"{f} " + (f"{b['variant']} [{b['block_n']},{b['num_warps']},{b['num_stages']}] "
                                    f"{b['ms']:.4f} ms {b['gbps']:.0f} GB/s x{b['per_byte_vs_bf16']:.2f}/byte"
                                    if b else "-"))
        lines.append(" | ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--budget-s", type=float, default=185.0, help="wall-clock budget for compiling and timing")
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--variants", nargs="+", default=VARIANTS)
    p.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="compile threads")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import torch

    from kvyard.bench.gpu_kernels import _time_ms

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = run(torch, SHAPES, args.formats, args.variants, tiles(), args.budget_s,
                 lambda fn: _time_ms(torch, fn, 20, args.rounds, graph=True), threads=args.threads, sms=sms)
    report.update(device=torch.cuda.get_device_name(0),
                  shape={"heads": NH, "kv_heads": NKV, "head_dim": HD, "block_size": BS})
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(shape_lines(report, args.formats)))
    print(json.dumps({"summary": {f: {k: v for k, v in s.items() if k != "best_config_by_shape"}
                                  for f, s in report["summary"].items()},
                      "suggested_defaults": report["suggested_defaults"], "errors": report["errors"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
