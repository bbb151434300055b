"""`kvyard bench quant`: the quantization lab on the demo model, CPU.

Rows: weight formats (bf16; the GGUF's Q4_1 read in place in float32, kvyard's default;
`--quantization` int8 / fp8 / int4 with float32 activations; with `--full` also the
bf16-activation variants) x KV cache dtype (auto / int8 / fp8, where the engine has
`kv_cache_dtype`; else listed as unavailable). Per row: model bytes (as laid out), the
worker's peak RSS, load time (the model alone, in process), TTFT and TPOT at
concurrency 1 and output tokens/s at 32 (a `kvyard worker` over HTTP, bench/client.py),
perplexity of the shipped text and a multiple-choice task through the API
(quant_accuracy.py), top-1 agreement and mean KL against bf16 (in process). Peer in the
same run: llama.cpp's quantizations of the same GGUF (quant_peer.py). The plot (size vs
perplexity, tokens/s in the legend) goes to `--plot`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from kvyard.bench.report import Report

WEIGHTS = [  # name, activation dtype, --quantization
    ("bf16", "bfloat16", None), ("q4_1 gguf (f32)", "float32", None),
    ("int8 (f32)", "float32", "int8"), ("fp8 (f32)", "float32", "fp8"), ("int4 (f32)", "float32", "int4")]
WEIGHTS_FULL = [("int8 (bf16)", "bfloat16", "int8"), ("int4 (bf16)", "bfloat16", "int4"),
                ("q4_1 gguf (bf16)", "bfloat16", "gguf")]
KV_DTYPES = ("auto", "int8", "fp8")
COLUMNS = ["engine", "weights", "kv", "model_MB", "peak_MB", "load_s", "ttft_c1_ms", "tpot_c1_ms",
           "tok_s_c32", "ppl", "mc_acc", "mc_acc_norm", "top1_agree", "kl"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="few requests and windows: a functional check")
    p.add_argument("--full", action="store_true", help="also the bf16-activation variants of each format")
    p.add_argument("--json", action="store_true")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="llama.cpp's binaries (llama-quantize, llama-perplexity, llama-server); "
                        "default $KVYARD_LLAMA_CPP; absent: the peer is listed as unavailable")
    p.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all cores)")
    p.add_argument("--plot", type=Path, default=None, help="write the size/perplexity/tok/s SVG here")
    p.add_argument("--weights", nargs="*", default=None, help="only these weight rows (names as printed)")
    p.add_argument("--kv", nargs="*", default=None, choices=KV_DTYPES, help="only these KV cache dtypes")


def kv_dtypes_available() -> tuple[str, ...]:
    """The KV dtypes this engine has: all of KV_DTYPES once EngineConfig has `kv_cache_dtype`."""
    from kvyard.workers.engine.config import EngineConfig

    return KV_DTYPES if "kv_cache_dtype" in {f.name for f in dataclasses.fields(EngineConfig)} else ("auto",)


def model_bytes(model) -> int:
    from kvyard.workers.model.quant.apply import weight_bytes

    total = sum(weight_bytes(t) for t in (model.embed, model.final_norm))
    if model.lm_head is not model.embed:
        total += weight_bytes(model.lm_head)
    for lw in model.layers:
        for name in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "down", "gate", "up"):
            t = getattr(lw, name)
            if t is not None:
                total += weight_bytes(t)
    return total


def in_process(weights: list[tuple[str, str, str | None]], windows: list[list[int]]) -> dict[str, dict[str, Any]]:
    """Load time, bytes, agreement and KL against bf16 per weight row (the model alone)."""
    import torch

    from kvyard.bench.quant_accuracy import divergence, window_logprobs
    from kvyard.common.models import resolve_model
    from kvyard.workers.model import load_model

    src = resolve_model("demo")
    ref = None
    out: dict[str, dict[str, Any]] = {}
    for name, dtype, q in [("bf16", "bfloat16", None)] + [w for w in weights if w[0] != "bf16"]:
        t0 = time.perf_counter()
        model, cfg = load_model(src, getattr(torch, dtype), 2048, quantization=q)
        load_s = time.perf_counter() - t0
        lps = [window_logprobs(model, cfg, w) for w in windows]
        ref = ref or lps
        d = divergence(ref, lps)
        out[name] = {"model_MB": model_bytes(model) / 2**20, "load_s": load_s, "top1_agree": d.agreement, "kl": d.kl}
        del model, lps
    return out


def _peak_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def serve_row(server, tok, windows, speed_prompts, n_c1: int, out_len: int, mc: bool,
              force_close: bool = False) -> dict[str, Any]:
    """Speed and API accuracy of one started server (kvyard's or llama-server)."""
    from kvyard.bench.engine_client import run_load
    from kvyard.bench.quant_accuracy import api_multiple_choice, api_perplexity, mc_items

    url = server.base_url
    c1 = asyncio.run(run_load(url, "demo", speed_prompts[:n_c1], 1, out_len, force_close=force_close))
    c32 = asyncio.run(run_load(url, "demo", speed_prompts[:32], 32, out_len, force_close=force_close))
    errors = c1.errors + c32.errors
    if errors:
        raise RuntimeError(f"{server.name}: {errors[0]}")
    row = {"ttft_c1_ms": c1.ttft(50) * 1e3, "tpot_c1_ms": c1.tpot(50) * 1e3, "tok_s_c32": c32.output_tok_s}
    if mc:
        row["ppl"] = api_perplexity(url, "demo", windows)
        s = api_multiple_choice(url, "demo", tok, mc_items())
        row["mc_acc"], row["mc_acc_norm"] = s.acc, s.acc_norm
    row["peak_MB"] = _peak_mb(server.pid)
    return row


def run(args: argparse.Namespace) -> int:
    from kvyard.bench.quant_accuracy import TEXT, text_windows
    from kvyard.bench.servers import worker
    from kvyard.common.tokenizer import load_tokenizer

    tok = load_tokenizer("demo")
    quick = args.quick
    weights = WEIGHTS + ([] if quick or not args.full else WEIGHTS_FULL)
    if args.weights:
        weights = [w for w in weights if w[0] in args.weights]
    windows = text_windows(tok, 256, 2 if quick else None)
    kl_windows = windows[:1 if quick else 4]
    speed_prompts = [w[:128] for w in text_windows(tok, 128, None)] * 2
    n_c1, out_len = (2, 16) if quick else (4, 64)
    kvs = kv_dtypes_available()
    threads = ["--num-threads", str(args.threads)] if args.threads else []
    rep = Report("kvyard bench quant: demo model (SmolLM2-135M, shipped as GGUF Q4_1), CPU", COLUMNS)
    rep.meta.update(quick=quick, text=TEXT.name, ppl_tokens=sum(len(w) - 1 for w in windows),
                    kl_positions=sum(len(w) for w in kl_windows), kv_available=list(kvs))
    local = in_process(weights, kl_windows)
    for name, dtype, q in weights:
        for kv in args.kv or KV_DTYPES:
            row: dict[str, Any] = {"engine": "kvyard", "weights": name, "kv": kv, **local[name]}
            if kv not in kvs:
                rep.add(**{**row, "model_MB": None, "load_s": None, "top1_agree": None, "kl": None,
                           "engine": "kvyard (n/a: no kv_cache_dtype)"})
                continue
            flags = ["--model", "demo", "--dtype", dtype, "--max-num-seqs", "32", "--served-model-name", "demo",
                     *threads, *(["--quantization", q] if q else []), *(["--kv-cache-dtype", kv] if kv != "auto" else [])]
            with worker(flags, name=f"kvyard-{q or dtype}-{kv}") as server:
                row.update(serve_row(server, tok, windows, speed_prompts, n_c1, out_len, True))
            rep.add(**row)
    _peer(args, rep, tok, windows, speed_prompts, n_c1, out_len)
    _notes(rep)
    if args.plot:
        _plot(rep, args.plot)
    rep.emit(args.json)
    return 0


def _peer(args, rep: Report, tok, windows, speed_prompts, n_c1: int, out_len: int) -> None:
    import os
    import subprocess

    from kvyard.bench.quant_accuracy import TEXT
    from kvyard.bench.quant_peer import PEER_TYPES, LlamaCpp, workdir
    from kvyard.common.models import demo_gguf_path

    cpp = LlamaCpp.find(args.llama_cpp)
    if cpp is None:
        rep.add(engine="llama.cpp (unavailable: give --llama-cpp DIR or $KVYARD_LLAMA_CPP)")
        return
    threads = args.threads or os.cpu_count() or 1
    src = demo_gguf_path()
    files = [("Q4_1 (as shipped)", src)] + [(t, cpp.quantize(src, t, workdir())) for t in ([] if args.quick else PEER_TYPES)]
    for name, gguf in files:
        row: dict[str, Any] = {"engine": "llama.cpp", "weights": name, "kv": "f16", "model_MB": gguf.stat().st_size / 2**20}
        try:  # a failing peer is a row that says so, not a lost run
            row["ppl"] = cpp.perplexity(gguf, TEXT, 256, threads)
            with cpp.server(gguf, threads, 32, 512) as server:
                row.update(serve_row(server, tok, windows, speed_prompts, n_c1, out_len, False, force_close=True))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            row["engine"] = f"llama.cpp (failed: {str(e)[:120]})"
        rep.add(**row)


def _notes(rep: Report) -> None:
    ours = [r for r in rep.rows if r.get("engine") == "kvyard" and r.get("tpot_c1_ms") is not None]
    peer = [r for r in rep.rows if r.get("engine") == "llama.cpp" and r.get("tpot_c1_ms") is not None]
    if ours:
        best = min(ours, key=lambda r: r["tpot_c1_ms"])
        rep.notes.append(f"fastest kvyard c1: {best['weights']} / kv {best['kv']}: TPOT {best['tpot_c1_ms']:.1f} ms, "
                         f"c32 {best['tok_s_c32']:.0f} tok/s")
        if peer:
            p = peer[0]
            rep.notes.append(f"llama.cpp {p['weights']}: TPOT {p['tpot_c1_ms']:.1f} ms, c32 {p['tok_s_c32']:.0f} tok/s; "
                             f"target c1 TPOT <= llama.cpp's: {'met' if best['tpot_c1_ms'] <= p['tpot_c1_ms'] else 'not met'}"
                             f" ({p['tpot_c1_ms'] / best['tpot_c1_ms']:.2f}x); c32 lead "
                             f"{max(r['tok_s_c32'] for r in ours) / max(r['tok_s_c32'] for r in peer):.2f}x")


def _plot(rep: Report, path: Path) -> None:
    from kvyard.bench.route_plot import svg

    series = {f"{r['engine'].split()[0]} {r['weights']} kv {r['kv']} ({r['tok_s_c32']:.0f} tok/s c32)":
              [(r["model_MB"], r["ppl"])] for r in rep.rows
              if r.get("ppl") is not None and r.get("tok_s_c32") is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg(series, "demo model: size vs perplexity (tokens/s at c32 in the legend)",
                        xlabel="model MB", ylabel="perplexity"))
