"""`kvyard bench gpu`: kvyard's Triton attention kernels and an 8B-shape decode step on CUDA,
each beside torch's own path measured in the same run.

- copy: one large device-to-device copy (bytes read + written / time): the
  HBM ceiling every roofline fraction here divides by.
- kernels: paged decode attention (scattered 16-token blocks) against torch's
  fastest SDPA backend on contiguous K/V of the same bytes, as a bandwidth
  ratio; paged prefill (fresh causal prompts) against torch's flash SDPA, as a
  TFLOP/s ratio. Headline ratios are geometric means over the shapes, with
  the kernels' default configs (what the engine runs); `--sweep` also times
  other tile configs and reports the best beside them.
- decode: the Llama-3-8B-shape step of kvyard/bench/gpu_step.py at each
  batch size, context `--context`: tokens/s and roofline fraction (bytes of
  weights + KV read per step / copy bandwidth / step time) for the engine's
  own model step (`decode`: LlamaForCausalLM on CudaOps + Triton) and plain
  torch (`decode_ref`), beside the hand-written variants, timed in
  alternating rounds.
- hf: kvyard's engine vs HF `generate` on one random 8B-shape HF directory
  (gpu_e2e.py): `hf_generate_ratio` per batch size (HF time / kvyard time).
- wake: sleep mode's wake to first token per level (gpu_wake.py), with its steps.
- serve: `kvyard worker --device cuda` over HTTP at several concurrencies (gpu_serve.py):
  TTFT, TPOT p50/p99, tokens/s beside the in-process engine's at the same batch.
wake and serve share one random 8B-shape HF directory (`--hf-dir`, else written once).
Timing: CUDA events around `--iters` back-to-back calls (graph replays for
the step), median of `--rounds` rounds. Data sizes are far above the 60 MB L2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any, Callable

from .gpu_kernels import (
    _time_ms, _geomean, copy_bandwidth, decode_kernels, _cfg, prefill_kernels,
)

TARGETS = {"decode_attn_vs_sdpa": 0.90, "prefill_attn_vs_flash": 0.70,
           "roofline": {"1": 0.75, "8": 0.75, "64": 0.80}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,8,64,256", help="decode-step batch sizes")
    p.add_argument("--context", type=int, default=1024, help="decode-step context per sequence")
    p.add_argument("--layers", type=int, default=32, help="decode-step layers (32 is the 8B shape)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--e2e-batches", default="1,8", help="hf part: batch sizes")
    p.add_argument("--e2e-prompt", type=int, default=128, help="hf part: prompt tokens")
    p.add_argument("--e2e-new", type=int, default=128, help="hf part: new tokens per sequence")
    p.add_argument("--e2e-rounds", type=int, default=3)
    p.add_argument("--scratch", default=None, help="hf part: where the 8B HF directory is written (default: tmp)")
    p.add_argument("--parts", default="kernels,decode,hf",
                   help="comma list of kernels,decode,hf,wake; or profile alone: kernel profiles of eager steps")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="also time other tile configs of the kernels")
    p.add_argument("--wake-rounds", type=int, default=5, help="wake part: sleeps and wakes per level")
    p.add_argument("--wake-max-seqs", type=int, default=64, help="wake part: engine max_num_seqs (graphs captured)")
    p.add_argument("--wake-plain-rounds", type=int, default=2,
                   help="wake part: wakes per level of an engine on plain allocations (the baseline; 0: none)")
    p.add_argument("--hf-dir", default=None, help="wake/serve parts: an existing 8B-shape HF directory")
    p.add_argument("--serve-concurrency", default="1,32,128", help="serve part: concurrent streams per level")
    p.add_argument("--serve-prompt", type=int, default=512, help="serve part: prompt tokens")
    p.add_argument("--serve-new", type=int, default=128, help="serve part: new tokens per request")
    p.add_argument("--serve-requests-per-stream", type=int, default=4, help="serve part: timed requests per stream")
    p.add_argument("--serve-worker-args", nargs="*", default=None, help="serve part: extra `kvyard worker` flags")
    p.add_argument("--label", default=os.environ.get("KVYARD_COMMIT", ""), help="recorded as meta.commit")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--json", action="store_true")


def decode_steps(torch, args: argparse.Namespace, copy_bps: float) -> dict[str, Any]:
    from kvyard.bench import gpu_step as S
    from kvyard.workers.attention.triton_decode import decode_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = S.make_weights(args.layers, args.context + 16)
    model = S.engine_model(args.layers, args.context + 16)
    variants = ["engine", "fused", "ref", "kvyard", "norm", "gemms"]
    res: dict[str, dict[str, Any]] = {v: {} for v in variants}
    for B in [int(x) for x in args.batches.split(",") if x]:
        b = S.make_batch(B, args.context, args.layers)
        cfg = decode_config(B, S.KV_HEADS, args.context, sms)
        graphs, logits, fns = {}, {}, {}
        for v in variants:
            # the closure owns the tensors its graph reads and writes: keep it as long as the graph
            fns[v] = fn = S.engine_step_fn(model, b) if v == "engine" else S.step_fn(v, w, b, cfg)
            logits[v] = fn().float()
            graphs[v] = S.capture(fn)[0]
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):   # alternate, so drift hits every variant alike
            for v in variants:
                times[v].append(_time_ms(torch, graphs[v].replay, args.iters, 1))
        for v in variants:
            # gemms: its own bytes (weights only), so its fraction says how close cuBLAS gets
            nbytes = w.bytes_per_step(B) + (0 if v == "gemms" else b.kv_bytes())
            floor_ms = nbytes / copy_bps * 1e3
            ms = statistics.median(times[v])
            # the engine's model has weights of its own: no logits to compare
            err = None if v == "engine" else ((logits[v] - logits["ref"]).norm() / logits["ref"].norm()).item()
            res[v][str(B)] = dict(ms_per_step=ms, tok_s=B / ms * 1e3, roofline_frac=floor_ms / ms,
                                  gb_per_step=nbytes / 1e9, logits_rel_err_vs_ref=err,
                                  spread_ms=[min(times[v]), max(times[v])], decode_config=_cfg(cfg))
        del graphs, logits, fns, fn, b
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return res


def profile_steps(torch, args: argparse.Namespace) -> None:
    """Eager kernel profiles of the ref and norm steps, in a process of their own (`--parts profile`):
    no graph is captured in a process that has run the profiler."""
    from kvyard.bench import gpu_step as S
    from kvyard.workers.attention.triton_decode import decode_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = S.make_weights(args.layers, args.context + 16)
    for B in [int(x) for x in args.batches.split(",") if x]:
        b = S.make_batch(B, args.context, args.layers)
        for v in ("ref", "norm"):
            fn = S.step_fn(v, w, b, decode_config(B, S.KV_HEADS, args.context, sms))
            fn()
            _profile(torch, fn, f"{v} step, batch {B}")
        del b, fn
        torch.cuda.empty_cache()


def _profile(torch, fn: Callable[[], Any], what: str) -> None:
    """Kernel names, counts and device times of one eager call (where the step's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"--- profile: {what}\n" + prof.key_averages().table(sort_by="device_time_total", row_limit=18),
              flush=True)
    except Exception as e:  # noqa: BLE001 - the profile is a diagnostic; the numbers stand without it
        print(f"--- profile of {what} failed: {e}", flush=True)


def _write_hf_dir(torch, args: argparse.Namespace, doc: dict[str, Any]) -> str:
    import tempfile
    import time

    from kvyard.bench.gpu_e2e import _hf_model

    d = tempfile.mkdtemp(prefix="kvyard-8b-", dir=args.scratch)
    t0 = time.perf_counter()
    hf = _hf_model(torch, args.layers)
    hf.save_pretrained(d, safe_serialization=True)
    del hf
    torch.cuda.empty_cache()
    doc["meta"]["hf_dir_write_s"] = time.perf_counter() - t0
    return d


def run(args: argparse.Namespace) -> int:
    import torch
    import triton

    from kvyard.bench.report import Report

    if not torch.cuda.is_available():
        print("kvyard bench gpu: no CUDA device here", flush=True)
        return 2
    torch.manual_seed(0)
    parts = set(args.parts.split(","))
    if "profile" in parts:
        profile_steps(torch, args)
        return 0
    copy_bps = copy_bandwidth(torch, args.rounds)
    doc: dict[str, Any] = {
        "title": "kvyard bench gpu", "kernels": None, "decode": None, "decode_ref": None,
        "hf_generate_ratio": None, "wake_s": None, "targets": TARGETS,
        "notes": [],
        "meta": dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                     sms=torch.cuda.get_device_properties(0).multi_processor_count, copy_tb_s=copy_bps / 1e12,
                     commit=args.label, rounds=args.rounds, iters=args.iters, context=args.context,
                     layers=args.layers),
    }
    tables: list[Report] = []

    def save() -> None:  # after each part, so a later failure keeps what was measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=2)

    if "kernels" in parts:
        dec = decode_kernels(torch, args.rounds, args.sweep)
        pre = prefill_kernels(torch, args.rounds, args.sweep)
        doc["kernels"] = dict(
            decode_attn_vs_sdpa=_geomean([r["ratio"] for r in dec]),
            prefill_attn_vs_flash=_geomean([r["ratio"] for r in pre if "ratio" in r]),
            decode_attn_vs_sdpa_best_config=_geomean([r["best_ratio"] for r in dec]),
            prefill_attn_vs_flash_best_config=_geomean([r["best_ratio"] for r in pre if "best_ratio" in r]),
            decode_rows=dec, prefill_rows=pre)
        t = Report("decode attention: paged (kvyard) vs best torch SDPA, same bytes",
                   ["batch", "context", "gb", "kvyard_tbs", "sdpa_tbs", "ratio", "best_ratio"])
        for r in dec:
            t.add(**r)
        tables.append(t)
        t = Report("prefill attention: paged (kvyard) vs torch flash SDPA", ["seqs", "cached", "new", "kvyard_tflops",
                                                                              "flash_tflops", "ratio", "best_tflops"])
        for r in pre:
            t.add(**r)
        tables.append(t)
        save()
    if "decode" in parts:
        steps = decode_steps(torch, args, copy_bps)
        doc["decode"], doc["decode_ref"] = steps["engine"], steps["ref"]
        doc["decode_variants"] = {"rope_in_kv_write": steps["fused"], "kvyard_unfused_rope": steps["kvyard"],
                                  "rope_in_kv_write_engine_norm_ops": steps["norm"], "gemms_only": steps["gemms"]}
        doc["notes"].append("decode = the engine's model step (LlamaForCausalLM on CudaOps: cuBLAS, Triton "
                            "add+RMSNorm and SiLU*up, RoPE in torch, Triton KV write and paged decode); "
                            "decode_ref = plain torch (cuBLAS + SDPA); all whole-step CUDA graphs, same GEMM shapes")
        t = Report(f"decode step, 8B shape, context {args.context} (roofline at {copy_bps / 1e12:.2f} TB/s copy)",
                   ["batch", "engine_tok_s", "engine_roof", "ref_tok_s", "ref_roof", "fused_roof", "norm_roof",
                    "gemms_roof"])
        for B in steps["ref"]:
            t.add(batch=B, engine_tok_s=steps["engine"][B]["tok_s"], engine_roof=steps["engine"][B]["roofline_frac"],
                  ref_tok_s=steps["ref"][B]["tok_s"], ref_roof=steps["ref"][B]["roofline_frac"],
                  fused_roof=steps["fused"][B]["roofline_frac"], norm_roof=steps["norm"][B]["roofline_frac"],
                  gemms_roof=steps["gemms"][B]["roofline_frac"])
        tables.append(t)
        save()
    if "hf" in parts:
        from kvyard.bench.gpu_e2e import hf_generate_ratio

        e2e = hf_generate_ratio(torch, args)
        doc["hf_generate"] = e2e
        doc["hf_generate_ratio"] = {b: r["ratio"] for b, r in e2e["batches"].items()}
        t = Report(f"end to end, 8B-shape HF dir, {e2e['prompt_tokens']} + {e2e['new_tokens']} tokens, greedy",
                   ["batch", "kvyard_tok_s", "hf_tok_s", "ratio"])
        for b, r in e2e["batches"].items():
            t.add(batch=b, kvyard_tok_s=r["kvyard_tok_s"], hf_tok_s=r["hf_tok_s"], ratio=r["ratio"])
        tables.append(t)
        save()
    own_dir = None
    if ("wake" in parts or "serve" in parts) and not args.hf_dir:
        own_dir = args.hf_dir = _write_hf_dir(torch, args, doc)
    try:
        if "wake" in parts:
            from kvyard.bench.gpu_wake import wake_times

            w = wake_times(torch, args)
            doc["wake"] = w
            doc["wake_s"] = {lvl: w[lvl]["wake_to_first_token_s"] for lvl in ("1", "2")}
            doc["notes"].append("wake_s = sleep mode's wake_up + one greedy token, 8B shape, p50 of --wake-rounds; "
                                "weights and KV cache at fixed addresses (sleep_arena.py), graphs kept (level 1: "
                                "one pinned host -> GPU copy; level 2: warm reload from the HF dir into the arena); "
                                "wake.plain = the same run's engine on plain allocations, graphs re-captured")
            t = Report("wake from sleep to first token, 8B shape (p50)",
                       ["engine", "level", "wake_to_first_token_s", "wake_up_s", "first_token_s", "sleep_s",
                        "freed_gib"])
            for tag, rows in (("arenas", w), ("plain", w.get("plain") or {})):
                for lvl in ("1", "2"):
                    if lvl in rows:
                        t.add(engine=tag, level=lvl, **{k: rows[lvl][k] for k in t.columns[2:]})
            tables.append(t)
            save()
        if "serve" in parts:
            from kvyard.bench.gpu_serve import serve

            sv = serve(torch, args, args.hf_dir)
            doc["serve"] = sv
            doc["notes"].append("serve = kvyard worker --device cuda over HTTP (aiohttp streaming client, loopback), "
                                "closed-loop streams; offline_tok_s = the in-process engine at the same batch, "
                                "same run")
            t = Report(f"online serving, 8B shape, {sv['prompt_tokens']} + {sv['new_tokens']} tokens, greedy",
                       ["concurrency", "requests", "tok_s", "offline_tok_s", "vs_offline", "ttft_p50_s",
                        "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms"])
            for r in sv.get("levels", {}).values():
                t.add(**{k: r[k] for k in t.columns})
            tables.append(t)
            save()
    finally:
        if own_dir:
            import shutil

            shutil.rmtree(own_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(doc, indent=2), flush=True)
    else:
        for t in tables:
            t.emit(False)
            print()
        if doc["kernels"]:
            k = doc["kernels"]
            print(f"decode_attn_vs_sdpa {k['decode_attn_vs_sdpa']:.3f} (best config {k['decode_attn_vs_sdpa_best_config']:.3f}), "
                  f"prefill_attn_vs_flash {k['prefill_attn_vs_flash']:.3f} "
                  f"(best config {k['prefill_attn_vs_flash_best_config']:.3f})", flush=True)
    return 0
