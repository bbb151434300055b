"""bf16 vs fp8 (and int8) KV cache for the 8B shape's paged decode attention on a GPU.

Runs on the GPU host without kvyard installed (tools/device_gpu.sh's shim tree on
PYTHONPATH): `python3 -m kvyard.bench.gpu_kvquant --out FILE.json [--quick]`.
For each (batch, context) the same Triton decode kernel reads a bf16 cache and a
quantized one (codes + a float32 scale per token and KV head; fp8_e4m3: bare codes,
kv_quant.py) holding the same random K/V; times are CUDA-event medians over captured graphs
(gpu_kernels._time_ms). Bytes are those the kernel must read: K and V rows of every
context token (+ q and out). Keys match issue 30's `kv_fp8`:
- `kv_bytes_ratio`: quantized bytes per token / bf16's (132 / 256 at head_dim 128; fp8_e4m3 128 / 256);
- `attn_throughput_per_byte_vs_bf16`: (bytes / time) quantized over bf16's, i.e. how
  well the kernel turns the smaller cache into speed (1.0: time halves with the bytes);
- `speedup_vs_bf16`: bf16 time / quantized time.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvyard.bench.gpu_kernels import _geomean

NH, NKV, HD, BS = 32, 8, 128, 16   # Llama-3-8B's attention
SHAPES = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 1024), (256, 512)]
QUICK_SHAPES = [(8, 4096), (64, 1024)]


def build(torch, B: int, ctx: int, dev: str = "cuda", dtype: Any = None) -> tuple[Any, Any, Any, Any]:
    """A bf16 cache of random K/V whose blocks are a random permutation, its tables, lengths and q."""
    nb = -(-ctx // BS)
    dtype = dtype or torch.bfloat16
    cache = torch.randn(2, B * nb + 1, BS, NKV, HD, dtype=dtype, device=dev)
    tables = torch.randperm(B * nb, device=dev).view(B, nb).to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B, NH, HD, dtype=dtype, device=dev)
    return cache, tables, lens, q


def quantized(torch, cache: Any, name: str) -> Any:
    """`cache` in format `name` (kv_quant.py's rows), in the engine's physical order (kv_layout.py)."""
    from kvyard.workers.attention import kv_quant

    from kvyard.workers.engine import kv_layout

    fmt = kv_quant.resolve_kv_format(name)
    hnd = kv_layout.uses_hnd(fmt.name, cache.device)   # the physical order the engine allocates
    c = kv_layout.allocate(kv_quant.cache_shape(tuple(cache.shape), fmt), hnd,
                           lambda shape: torch.empty(shape, dtype=fmt.dtype, device=cache.device))
    c.view(torch.uint8).copy_(kv_quant.quantize(cache, fmt))
    return c


def kv_bytes(B: int, ctx: int, q_numel: int, name: str) -> int:
    """Bytes a decode step must read and write: K and V rows of every context token, q and out."""
    from kvyard.workers.attention import kv_quant

    per_tok = 2 * NKV * (HD * 2 if name == "bf16" else HD + kv_quant.resolve_kv_format(name).scale_bytes)
    return B * ctx * per_tok + 2 * q_numel * 2


def measure(torch, B: int, ctx: int, fmts: list[str], rounds: int) -> dict[str, Any]:
    from dataclasses import replace

    from kvyard.bench.gpu_kernels import _time_ms
    from kvyard.workers.attention.triton_decode import DecodeWorkspace, decode_config, paged_decode
    from kvyard.workers.attention.triton_decode_bare import splits_for

    dev = "cuda"
    cache, tables, lens, q = build(torch, B, ctx, dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = decode_config(B, NKV, tables.shape[1] * BS, sms)
    out = torch.empty_like(q)
    ws = DecodeWorkspace.allocate(B, NH, HD, cfg.num_splits, dev) if cfg.num_splits > 1 else None
    scale = HD ** -0.5
    row = {"batch": B, "context": ctx, "splits": cfg.num_splits}
    ref = None
    for name in ["bf16", *fmts]:
        c = cache if name == "bf16" else quantized(torch, cache, name)
        cf, wf = cfg, ws
        if name == "fp8_e4m3":   # as paged_decode configures it by itself (triton_decode_bare.splits_for)
            cf = replace(cfg, num_splits=splits_for(cfg.num_splits, tables.shape[1] * BS))
            wf = DecodeWorkspace.allocate(B, NH, HD, cf.num_splits, dev) if cf.num_splits > 1 else None

        def call(c=c, cf=cf, wf=wf):
            return paged_decode(q, c, tables, lens, scale, out=out, config=cf, workspace=wf)
        ms = _time_ms(torch, call, 20, rounds, graph=True)
        got = call().float()
        if ref is None:
            ref = got
        nbytes = kv_bytes(B, ctx, q.numel(), name)
        row[name] = {"ms": round(ms, 4), "bytes": nbytes, "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1),
                     "rel_err_vs_bf16": round(float((got - ref).norm() / ref.norm()), 5)}
        del c
    for name in fmts:
        r, b = row[name], row["bf16"]
        r["kv_bytes_ratio"] = round(r["bytes"] / b["bytes"], 4)
        r["speedup_vs_bf16"] = round(b["ms"] / r["ms"], 3)
        r["attn_throughput_per_byte_vs_bf16"] = round((r["bytes"] / r["ms"]) / (b["bytes"] / b["ms"]), 3)
    return row


def split_sweep(torch, B: int, ctx: int, fmts: list[str], mults: list[int], rounds: int) -> dict[str, Any]:
    """Each format's time with decode_config's splits times each of `mults` (at most ctx / 128
    tokens a split, 64 splits): whether a kernel wants more programs than bf16's rule gives."""
    from dataclasses import replace

    from kvyard.bench.gpu_kernels import _time_ms
    from kvyard.workers.attention.triton_decode import DecodeWorkspace, decode_config, paged_decode

    cache, tables, lens, q = build(torch, B, ctx)
    base = decode_config(B, NKV, tables.shape[1] * BS, torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.empty_like(q)
    res: dict[str, Any] = {"batch": B, "context": ctx, "base_splits": base.num_splits}
    for name in ["bf16", *fmts]:
        c = cache if name == "bf16" else quantized(torch, cache, name)
        times = {}
        for m in mults:
            s = max(1, min(64, ctx // 128, base.num_splits * m))
            if s in times:
                continue
            cfg = replace(base, num_splits=s, block_n=128 if s > 1 else 64)
            ws = DecodeWorkspace.allocate(B, NH, HD, s, "cuda") if s > 1 else None
            times[s] = round(_time_ms(torch, lambda: paged_decode(q, c, tables, lens, HD ** -0.5, out=out, config=cfg,
                                                                  workspace=ws), 20, rounds, graph=True), 4)
        best = min(times, key=times.get)
        res[name] = {"ms_by_splits": times, "best_splits": best, "best_ms": times[best],
                     "bytes": kv_bytes(B, ctx, q.numel(), name)}
        del c
    for name in fmts:
        r, b = res[name], res["bf16"]
        r["per_byte_best_vs_bf16_best"] = round((r["bytes"] / r["best_ms"]) / (b["bytes"] / b["best_ms"]), 3)
        r["speedup_best_vs_bf16_best"] = round(b["best_ms"] / r["best_ms"], 3)
    return res


def profile_once(torch, B: int, ctx: int, fmts: list[str]) -> int:
    """Each format's decode kernel launched twice (compile, then the one to profile), eagerly."""
    from kvyard.workers.attention.triton_decode import DecodeWorkspace, decode_config, paged_decode

    cache, tables, lens, q = build(torch, B, ctx)
    cfg = decode_config(B, NKV, tables.shape[1] * BS, torch.cuda.get_device_properties(0).multi_processor_count)
    ws = DecodeWorkspace.allocate(B, NH, HD, cfg.num_splits, "cuda") if cfg.num_splits > 1 else None
    for name in ["bf16", *fmts]:
        c = cache if name == "bf16" else quantized(torch, cache, name)
        for _ in range(2):
            paged_decode(q, c, tables, lens, HD ** -0.5, out=torch.empty_like(q), config=cfg, workspace=ws)
        torch.cuda.synchronize()
        print(name, "launched", flush=True)
    return 0


BARE_GRID = [(v, bn, w, st) for v in ("mixed", "words", "bytes") for bn, w, st in
             ((128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 4, 2))] + \
    [("gluon", bn, w, st) for bn, w, st in ((64, 4, 2), (128, 4, 2), (64, 4, 4), (64, 2, 4), (64, 2, 6),
                                            (32, 2, 3), (32, 2, 4), (32, 2, 5), (32, 2, 6), (32, 2, 8),
                                            (32, 1, 4), (32, 1, 6), (16, 1, 4), (16, 1, 6), (16, 1, 8),
                                            (16, 1, 12))]
# gluon: its stages are its ring of cp.async buffers (2: double-buffered). Deeper rings keep
# more tiles in flight a program without the registers a register prefetch costs; small
# one-warp programs fit many an SM (sm_90 builds: 16/1 x4 at 157 registers and 20 KiB of shared
# memory, 11 programs, 132 KiB in flight; 64/4 x2 3 programs, 48 KiB).


def use_triton() -> str:
    """Launch fp8_e4m3 decode with the Triton kernel's picks (triton_decode_bare.TRITON_TILES and
    TRITON_SPLITS_X) in place of the engine's default, the Gluon ring, in this process; a label
    for the results."""
    from kvyard.workers.attention import triton_decode_bare

    tiles, splits_x = triton_decode_bare.triton_launches()
    triton_decode_bare.TILES.update(tiles)
    triton_decode_bare.SPLITS_X = splits_x
    return f"{launch_label(tiles['split'], splits_x)}, unsplit {launch_label(tiles['unsplit'])}"


def launch_label(tile: tuple, splits_x: int | None = None) -> str:
    return "/".join(map(str, tile)) + ("" if splits_x is None else f" splits x{splits_x}")


def pick_bare(times: dict[str, dict[str, dict[tuple, float]]]) -> dict[str, Any]:
    """times: kind (split/unsplit) -> shape -> {(variant, block_n, warps, stages, splits_x): ms}.
    Per kind, the key timed at every shape with the best geomean of time over that shape's best
    (pure: tested on made-up timings)."""
    pick = {}
    for kind, per in times.items():
        common = set.intersection(*(set(r) for r in per.values())) if per else set()
        if not common:
            continue
        score = {k: _geomean([r[k] / min(r.values()) for r in per.values()]) for k in common}
        k = min(score, key=lambda k: (score[k], k))
        pick[kind] = {"variant": k[0], "tile": list(k[1:4]), "splits_x": k[4],
                      "slowdown_vs_per_shape_best": round(score[k], 3)}
    return pick


def bare_tune(torch, shapes: list[tuple[int, int]], rounds: int, variants: set[str] | None = None) -> dict[str, Any]:
    """fp8_e4m3's kernel (triton_decode_bare.py) per variant and tile at each shape, and the one
    (variant, tile) per split/unsplit launch with the best geomean time, split launches also over
    decode_config's splits x 1, 2, 4: what to put in its TILES and SPLITS_X. `variants`: only
    BARE_GRID's tiles of these."""
    from dataclasses import replace

    from kvyard.bench.gpu_kernels import _time_ms
    from kvyard.workers.attention.triton_decode import DecodeWorkspace, decode_config, paged_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    times: dict[str, dict[str, dict[tuple, float]]] = {"split": {}, "unsplit": {}}
    for B, ctx in shapes:
        cache, tables, lens, q = build(torch, B, ctx)
        c = quantized(torch, cache, "fp8_e4m3")
        del cache
        base = decode_config(B, NKV, tables.shape[1] * BS, sms)
        out = torch.empty_like(q)
        row = times["split" if base.num_splits > 1 else "unsplit"].setdefault(f"{B}x{ctx}", {})
        for mult in ((1, 2, 4) if base.num_splits > 1 else (1,)):
            S = max(1, min(64, base.num_splits * mult, ctx // 128))
            ws = DecodeWorkspace.allocate(B, NH, HD, S, "cuda") if S > 1 else None
            for v, bn, w, st in (t for t in BARE_GRID if variants is None or t[0] in variants):
                cfg = replace(base, num_splits=S, quant_variant=v, quant_block_n=bn, quant_num_warps=w,
                              quant_num_stages=st)
                try:
                    row[(v, bn, w, st, mult)] = _time_ms(torch, lambda cfg=cfg, ws=ws: paged_decode(
                        q, c, tables, lens, HD ** -0.5, out=out, config=cfg, workspace=ws), 20, rounds, graph=True)
                except Exception as e:   # a tile over the shared-memory limit
                    print("bare", B, ctx, v, bn, w, st, mult, "failed:", str(e)[:100], flush=True)
        best = min(row, key=row.get)
        print(f"bare {B}x{ctx}: best {best} {row[best]:.4f} ms; by variant " + ", ".join(
            f"{v} {min(t for k, t in row.items() if k[0] == v):.4f}" for v in dict.fromkeys(k[0] for k in row)),
            flush=True)
        del c
    return {"suggested": pick_bare(times), "ms": {kind: {sh: {"/".join(map(str, k)): round(t, 4) for k, t in r.items()}
                                             for sh, r in per.items()} for kind, per in times.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="two shapes, fewer rounds (a functional check)")
    p.add_argument("--formats", nargs="+", default=["fp8", "fp8_e4m3", "int8"])
    p.add_argument("--defaults-from", default=None,
                   help="a gpu_kvquant_tune JSON: time the quantized kernels with its suggested_defaults "
                        "in place of triton_decode_quant_fast.DEFAULTS (what pasting them there gives)")
    p.add_argument("--variant", default=None, help="run the quantized formats with this variant (DEFAULTS' tiles)")
    p.add_argument("--ncu", default=None, metavar="B,CTX",
                   help="no timing: launch each kernel twice at one shape, eagerly, for Nsight Compute")
    p.add_argument("--split-mults", default=None, metavar="M,M,..",
                   help="also time every shape with decode_config's splits times each M (`split_sweep` in the JSON)")
    p.add_argument("--bare-tune", action="store_true",
                   help="first time fp8_e4m3's kernel per variant and tile (`bare_tune`) and run with its pick")
    p.add_argument("--triton", action="store_true",
                   help="fp8_e4m3 decode launches the Triton kernel's picks (TRITON_TILES) in place of the Gluon ring")
    p.add_argument("--bare-variants", default=None, metavar="V,V,..",
                   help="the bare tune times only these variants' tiles (default: all of BARE_GRID)")
    args = p.parse_args(argv)
    import torch

    if args.defaults_from:
        from kvyard.workers.attention.triton_decode_quant_fast import DEFAULTS, QuantTile

        with open(args.defaults_from) as f:
            for fmt, kinds in json.load(f)["suggested_defaults"].items():
                for kind, t in kinds.items():
                    DEFAULTS[fmt][kind] = QuantTile(t["variant"], t["block_n"], t["num_warps"], t["num_stages"])
        print("quantized kernels:", DEFAULTS, flush=True)

    if args.variant:
        from kvyard.workers.attention.triton_decode_quant_fast import DEFAULTS, QuantTile

        for kinds in DEFAULTS.values():
            for kind, t in kinds.items():
                kinds[kind] = QuantTile(args.variant, t.block_n, t.num_warps, t.num_stages)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if args.ncu:
        B, ctx = (int(x) for x in args.ncu.split(","))
        return profile_once(torch, B, ctx, args.formats)
    from kvyard.workers.attention import triton_decode_bare

    rounds = 3 if args.quick else 7
    tune = None
    if args.triton:
        print("fp8_e4m3 kernel:", use_triton(), flush=True)
    if args.bare_tune:
        tune = bare_tune(torch, QUICK_SHAPES if args.quick else SHAPES, 5,
                         set(args.bare_variants.split(",")) if args.bare_variants else None)
        pick = tune["suggested"]
        for kind, t in pick.items():
            triton_decode_bare.TILES[kind] = (t["variant"], *t["tile"])
        triton_decode_bare.SPLITS_X = pick.get("split", {}).get("splits_x", 1)
        print("fp8_e4m3 kernel:", triton_decode_bare.TILES, "splits x", triton_decode_bare.SPLITS_X, flush=True)
    launches = {"split": launch_label(triton_decode_bare.TILES["split"], triton_decode_bare.SPLITS_X),
                "unsplit": launch_label(triton_decode_bare.TILES["unsplit"])}
    rows = []
    for B, ctx in (QUICK_SHAPES if args.quick else SHAPES):
        rows.append(measure(torch, B, ctx, args.formats, rounds))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"device": torch.cuda.get_device_name(0), "shape": {"heads": NH, "kv_heads": NKV, "head_dim": HD,
                                                                   "block_size": BS},
               "fp8_e4m3_launches": launches, "rows": rows}
    if tune:
        summary["bare_tune"] = tune
    if args.split_mults:
        mults = [int(m) for m in args.split_mults.split(",")]
        summary["split_sweep"] = []
        for B, ctx in (QUICK_SHAPES if args.quick else SHAPES):
            summary["split_sweep"].append(split_sweep(torch, B, ctx, args.formats, mults, rounds))
            print(json.dumps(summary["split_sweep"][-1]), flush=True)
        for name in args.formats:
            summary[f"split_sweep_{name}"] = {
                "per_byte_best_vs_bf16_best": round(_geomean([r[name]["per_byte_best_vs_bf16_best"]
                                                              for r in summary["split_sweep"]]), 3),
                "speedup_best_vs_bf16_best": round(_geomean([r[name]["speedup_best_vs_bf16_best"]
                                                             for r in summary["split_sweep"]]), 3)}
    for name in args.formats:
        summary[f"kv_{name}"] = {
            "kv_bytes_ratio": rows[0][name]["kv_bytes_ratio"],
            "attn_throughput_per_byte_vs_bf16": round(_geomean([r[name]["attn_throughput_per_byte_vs_bf16"]
                                                                for r in rows]), 3),
            "speedup_vs_bf16": round(_geomean([r[name]["speedup_vs_bf16"] for r in rows]), 3),
        }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k.startswith(("kv_", "split_sweep_"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
