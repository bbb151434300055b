"""Weight quantization on CUDA (issue 30's `quant` section): `python3 -m kvyard.bench.gpu_quant
--out FILE.json` on the GPU host (kvyard need not be installed: tools/device_gpu.sh's shim).

An 8B-shaped model (gpu_step.py's shapes, random weights) built by the engine's loader per
mode: bf16, fp8 (E4M3 weights, `_scaled_mm` with per-row activation scales on Hopper),
int8 (W8A16, Triton dequant-GEMM), int4 (group-32, Triton dequant-GEMM). Per mode: load
time (build + quantize), weight memory, decode tok/s at batch 1/8/64 (one CUDA-graph
replay per step, the engine's step as `kvyard worker` replays it, over block tables as wide
as the model's max length as the engine's graph buffers are) and its fraction of the
HBM roofline for the bytes the step reads (weights as stored + the batch's KV), against
copy bandwidth measured in the same run; prefill TFLOP/s (one 2,048-token prompt, the
matmul FLOPs 2 x params x tokens plus causal attention). On the demo model (float32
activations), each mode's greedy (top-1) agreement and mean KL against the unquantized
model over windows of the shipped text, on the GPU. Each mode decodes over each of
`--kv-dtypes` (bf16, and the quantized formats of `--kv-cache-dtype`: the same K/V re-stored,
the roofline's KV bytes as stored); the KV format's own bench (gpu_kvquant) times the
attention kernels alone.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

MODES = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "int4"}
BATCHES = (1, 8, 64)


def roofline_frac(bytes_read: int, seconds: float, bandwidth: float) -> float:
    """Share of the memory roofline a step reached: its bytes at `bandwidth` over its time."""
    return bytes_read / bandwidth / seconds if seconds > 0 and bandwidth > 0 else float("nan")


def prefill_flops(cfg, tokens: int, params: int) -> float:
    """Matmul FLOPs of one causal prefill: 2 x params x tokens (weights), plus QK^T and PV over
    the causal half (2 x 2 x heads x head_dim x tokens^2 / 2 per layer)."""
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens
    return 2.0 * params * tokens + attn


def layer_params(cfg) -> int:
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + cfg.vocab_size * h


def step_bytes(model, kv_bytes: int) -> int:
    """What a decode step reads: the layers' matrices as stored, the head, the batch's KV."""
    from kvyard.bench.quant import model_bytes

    embed = model.embed.numel() * model.embed.element_size()
    return model_bytes(model) - embed + kv_bytes


def copy_bandwidth(torch, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (the roofline's bytes)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * n / (time.perf_counter() - t0)


def _time(torch, fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def in_kv_format(torch, b, name: str) -> None:
    """The batch's paged caches re-stored in KV format `name` (bf16: left as they are), layer by
    layer, in the engine's physical order."""
    from kvyard.bench.gpu_kvquant import quantized

    if name != "bf16":
        for i, p in enumerate(b.paged):
            b.paged[i] = quantized(torch, p, name)


def measure_mode(torch, method: str | None, layers: int, ctx: int, bw: float, narrow: bool = False,
                 kv_dtypes: tuple[str, ...] = ("bf16",)) -> dict[str, Any]:
    from dataclasses import replace

    from kvyard.bench import gpu_step as gs
    from kvyard.workers.model.loader import build

    cfg = replace(gs.config_8b(ctx + 2048), num_layers=layers)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = build(cfg, gs.RandomSource(cfg), gs.DTYPE, ctx + 2048, device="cuda", quantization=method)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0,
                           "memory_gb": (torch.cuda.memory_allocated() - base) / 1e9,
                           "decode_tok_s": {}, "roofline_frac": {}, "step_ms": {}}
    for kv in kv_dtypes:   # bf16's figures at the top level, the others under kv_NAME
        rec = out if kv == "bf16" else out.setdefault(f"kv_{kv}", {"decode_tok_s": {}, "roofline_frac": {},
                                                                   "step_ms": {}})
        for batch in BATCHES:
            b = gs.make_batch(batch, ctx, layers, dense=False, max_len=None if narrow else ctx + 2048)
            in_kv_format(torch, b, kv)
            graph, _ = gs.capture(gs.engine_step_fn(model, b))
            s = _time(torch, graph.replay, 20)
            rec["decode_tok_s"][str(batch)] = batch / s
            rec["step_ms"][str(batch)] = s * 1e3
            rec["roofline_frac"][str(batch)] = roofline_frac(step_bytes(model, b.kv_bytes()), s, bw)
            del graph, b
            torch.cuda.empty_cache()
    n = 2048
    from kvyard.workers.attention.reference import SeqStep, build_metadata
    from kvyard.workers.model import kv_cache_shape

    caches = [torch.zeros(kv_cache_shape(cfg, n // 16, 16), dtype=gs.DTYPE, device="cuda") for _ in range(layers)]
    ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
    pos = torch.arange(n, device="cuda")
    meta = build_metadata([SeqStep(list(range(n // 16)), 0, n)], 16, 0)
    last = torch.tensor([n - 1], device="cuda")
    with torch.inference_mode():
        s = _time(torch, lambda: model(ids, pos, caches, meta, out_rows=last), 3)
    out["prefill_tflops"] = prefill_flops(cfg, n, layer_params(cfg)) / s / 1e12
    return out  # the model and caches go with this frame


def profile_b1(torch, method: str | None, layers: int, ctx: int, narrow: bool = False) -> dict[str, Any]:
    """GPU time per kernel over 3 eager batch-1 steps (what a graph replays, launch gaps not
    counted): which kernels hold the step beside the weight stream. Run after every graph: no
    graph is captured in a process that has run the profiler."""
    from dataclasses import replace

    from kvyard.bench import gpu_step as gs
    from kvyard.workers.model.loader import build

    cfg = replace(gs.config_8b(ctx + 2048), num_layers=layers)
    model = build(cfg, gs.RandomSource(cfg), gs.DTYPE, ctx + 2048, device="cuda", quantization=method)
    b = gs.make_batch(1, ctx, layers, dense=False, max_len=None if narrow else ctx + 2048)
    return gs.kernel_profile(gs.engine_step_fn(model, b), top=20)


def demo_accuracy(torch, windows: int) -> dict[str, dict[str, float]]:
    """float32 demo model on the GPU: each mode against the unquantized one."""
    from kvyard.bench.quant_accuracy import divergence, text_windows, window_logprobs
    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.model import load_model

    wins = text_windows(load_tokenizer("demo"), 256, windows)
    ref = None
    out = {}
    for name, method in MODES.items():
        model, cfg = load_model(resolve_model("demo"), torch.float32, 2048, device="cuda", quantization=method)
        lps = [window_logprobs(model, cfg, w) for w in wins]
        ref = ref or lps
        d = divergence(ref, lps)
        out[name] = {"greedy_agreement": d.agreement, "kl": d.kl}
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m kvyard.bench.gpu_quant")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--ctx", type=int, default=1024, help="every sequence's context at decode")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--windows", type=int, default=4, help="text windows of 256 tokens for agreement/KL")
    p.add_argument("--profile", default="", help="modes whose eager batch-1 step is profiled per kernel, last")
    p.add_argument("--kv-dtypes", default="bf16,fp8_e4m3",
                   help="KV caches each mode decodes over: bf16 (always) and any of fp8_e4m3, fp8, int8")
    p.add_argument("--narrow-tables", action="store_true",
                   help="block tables only as wide as the context (its splits, not the engine's)")
    p.add_argument("--triton", action="store_true",
                   help="fp8_e4m3 KV decodes with the Triton kernel's picks in place of the Gluon ring")
    a = p.parse_args(argv)
    from kvyard.workers.attention.kv_quant import KV_CACHE_DTYPES

    kv_dtypes = ("bf16", *dict.fromkeys(k for k in a.kv_dtypes.split(",") if k and k != "bf16"))
    if not set(kv_dtypes[1:]) <= set(KV_CACHE_DTYPES) - {"auto"}:
        p.error(f"--kv-dtypes: bf16 and any of {', '.join(k for k in KV_CACHE_DTYPES if k != 'auto')}")
    import torch

    if not torch.cuda.is_available():
        print("gpu_quant needs CUDA", file=sys.stderr)
        return 2
    bw = copy_bandwidth(torch)
    res: dict[str, Any] = {"card": torch.cuda.get_device_name(), "copy_gb_s": bw / 1e9, "layers": a.layers,
                           "ctx": a.ctx, "narrow_tables": a.narrow_tables, "quant": {}}
    if a.triton:
        from kvyard.bench.gpu_kvquant import use_triton

        res["fp8_e4m3_kernel"] = use_triton()
    for name in filter(None, a.modes.split(",")):  # --modes= : the demo accuracy alone
        res["quant"][name] = measure_mode(torch, MODES[name], a.layers, a.ctx, bw, a.narrow_tables, kv_dtypes)
        torch.cuda.empty_cache()
        print(name, json.dumps(res["quant"][name]), flush=True)
    try:
        res["demo_accuracy"] = demo_accuracy(torch, a.windows)
    except (ImportError, OSError, RuntimeError) as e:  # no demo GGUF on the host (ModelNotFound)
        res["demo_accuracy"] = {"error": str(e)}
    print(json.dumps(res.get("demo_accuracy")), flush=True)
    for name in filter(None, a.profile.split(",")):
        prof = profile_b1(torch, MODES[name], a.layers, a.ctx, a.narrow_tables)
        res.setdefault("profile_b1", {})[name] = prof
        torch.cuda.empty_cache()
        print("profile", name, json.dumps(prof, indent=1), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
