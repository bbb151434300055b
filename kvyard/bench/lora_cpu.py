"""The CPU LoRA step: lora.c (one C call per projection for all adapters) vs the torch
path (a pair of GEMMs per adapter group, torch on one thread beside gemm.c), paired.

Two engines share the demo model, identical but for their LoRA manager (the torch
one built with `use_kernels=False`); each repetition runs the same closed-loop load
(`lora_engine._run`: `concurrency` requests, each adapter drawn with Zipf popularity,
rank-16 adapters on all seven projections) on both, alternating which goes first, and
the ratio of their throughputs is one pair; the base model alone runs after each pair
for reference. The medians over the repetitions are the result; the machine's other
load moves both halves of a pair alike.

    python -m kvyard.bench.lora_cpu [--quick] [--reps 5] [--dtype float32|bfloat16]
    python -m kvyard.bench.lora_cpu --ops      # the LoRA ops of a step alone
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path


def _engines(dtype: str, n_adapters: int, d: Path):
    import torch

    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.lora.config import LoRAConfig, LoRAModule
    from kvyard.workers.lora.manager import LoRAManager
    from kvyard.workers.model import load_model

    from ._lora_files import write_adapter

    model, cfg = load_model(resolve_model("demo"), getattr(torch, dtype))
    tok = load_tokenizer("demo")
    mods = [LoRAModule(f"a{i}", str(write_adapter(d / f"a{i}", cfg, rank=16, seed=i))) for i in range(n_adapters)]
    lc = LoRAConfig(max_loras=n_adapters, max_lora_rank=16, max_cpu_loras=n_adapters, modules=mods)
    conf = EngineConfig(dtype=dtype, kv_cache_memory_bytes=256 << 20, lora=lc, enable_prefix_caching=False)
    c_engine, t_engine = LLMEngine(conf, model, cfg, tok), LLMEngine(conf, model, cfg, tok)
    torch_mgr = LoRAManager(lc, cfg, torch.device("cpu"), t_engine.dtype, use_kernels=False)
    for m in mods:
        torch_mgr.add(m)
    t_engine.lora = t_engine.runner.lora = torch_mgr
    assert c_engine.lora.cpu is not None, "the C kernels did not load"
    return c_engine, t_engine, tok


def measure(quick: bool, reps: int = 5, dtype: str = "float32") -> dict:
    from .lora_engine import _run, _zipf_names

    concurrencies, adapter_counts = ([8], [4]) if quick else ([8, 32], [4, 16])
    reps = 2 if quick else reps
    max_tokens = 4 if quick else 16
    out: dict = {"model": "demo", "dtype": dtype, "rank": 16, "max_tokens": max_tokens, "reps": reps,
                 "threads": None, "rows": []}
    with tempfile.TemporaryDirectory() as d:
        c_engine, t_engine, tok = _engines(dtype, max(adapter_counts), Path(d))
        out["threads"] = c_engine.runner.num_threads
        for c in concurrencies:
            prompts = [tok.encode(f"Request {i}: tell me something about number {i * 7}.") for i in range(c)]
            for k in adapter_counts:
                names = _zipf_names(k, c, random.Random(k * 1000 + c))
                for e in (c_engine, t_engine):  # warm-up: slots filled, buffers sized
                    _run(e, prompts, names, 2)
                pairs, base = [], []
                for rep in range(reps):
                    order = (c_engine, t_engine) if rep % 2 == 0 else (t_engine, c_engine)
                    got = {id(e): _run(e, prompts, names, max_tokens) for e in order}
                    pairs.append((got[id(c_engine)], got[id(t_engine)]))
                    base.append(_run(c_engine, prompts, [None] * c, max_tokens)["tok_s"])
                out["rows"].append({
                    "concurrency": c, "adapters": k, "distinct_in_batch": len(set(names)),
                    "c_tok_s": statistics.median(p[0]["tok_s"] for p in pairs),
                    "torch_tok_s": statistics.median(p[1]["tok_s"] for p in pairs),
                    "c_tpot_ms": statistics.median(p[0]["tpot_ms"] for p in pairs),
                    "torch_tpot_ms": statistics.median(p[1]["tpot_ms"] for p in pairs),
                    "base_tok_s": statistics.median(base),
                    "ratio_median": statistics.median(p[0]["tok_s"] / p[1]["tok_s"] for p in pairs),
                    "ratios": [round(p[0]["tok_s"] / p[1]["tok_s"], 3) for p in pairs]})
    return out


def measure_ops(reps: int = 7) -> list[dict]:
    """The LoRA ops of one step alone (`LoRABatch.apply` for the 30 layers' four projections,
    demo-model shapes, float32, random rank-16 weights in 16 slots, one thread): lora.c, its
    portable build, and the torch path; medians of `reps` in ms."""
    import time

    import torch

    from kvyard.common.models import resolve_model
    from kvyard.workers.cpu_ops import load
    from kvyard.workers.cpu_ops.lora_args import LoraWeights
    from kvyard.workers.lora.adapter import projection_shapes
    from kvyard.workers.lora.batch import CpuLoRA, LoRABatch
    from kvyard.workers.model import load_model

    from .lora_engine import _zipf_names

    shapes = projection_shapes(load_model(resolve_model("demo"), torch.float32)[1])
    slots, rank, layers = 16, 16, 30
    gen = torch.Generator().manual_seed(0)
    stacks = [{p: (torch.randn(slots, len(sl) * rank, k, generator=gen) * 0.01,
                   torch.randn(slots, len(sl) * rank, sl[-1][0] + sl[-1][1], generator=gen).transpose(1, 2) * 0.01)
               for p, (k, sl) in shapes.items()} for _ in range(layers)]
    noff = {p: torch.tensor([c for c, _ in sl] + [sl[-1][0] + sl[-1][1]], dtype=torch.int32)
            for p, (_, sl) in shapes.items()}
    weights = [{p: LoraWeights.prepare(a, b, noff[p]) for p, (a, b) in layer.items()} for layer in stacks]
    ranks = {p: [rank] * slots for p in shapes}
    paths = {"lora.c": CpuLoRA(load(), weights, ranks), "lora.c portable": CpuLoRA(load(True), weights, ranks),
             "torch": None}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for t, k in ((8, 4), (8, 16), (32, 4), (32, 16)):
            names = _zipf_names(k, t, random.Random(t * 100 + k))
            row_slots = [int(n[1:]) for n in names]
            xs = {p: torch.randn(t, k_in, generator=gen) for p, (k_in, _) in shapes.items()}
            ys = {p: torch.randn(t, sl[-1][0] + sl[-1][1], generator=gen) for p, (_, sl) in shapes.items()}
            row: dict = {"rows": t, "adapters": k}
            for name, cpu in paths.items():
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    batch = LoRABatch.build(row_slots, stacks, frozenset(shapes), slots, torch.device("cpu"), cpu)
                    for i in range(layers):
                        for p in shapes:
                            batch.apply(i, p, xs[p], ys[p])
                    times.append(time.perf_counter() - t0)
                row[name] = 1e3 * statistics.median(times)
            rows.append(row)
    finally:
        torch.set_num_threads(before)
    return rows


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as kvyard.cli.main sets it for the worker
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--ops", action="store_true", help="the LoRA ops alone (measure_ops), not the engine")
    a = ap.parse_args()
    if a.ops:
        rows = measure_ops()
        print("| rows | adapters | lora.c ms | lora.c portable ms | torch ms |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['rows']} | {r['adapters']} | {r['lora.c']:.1f} | {r['lora.c portable']:.1f} | {r['torch']:.1f} |")
        return
    res = measure(a.quick, a.reps, a.dtype)
    print(json.dumps(res, indent=1))
    print("| concurrency | adapters (distinct) | base tok/s | lora.c tok/s | torch tok/s | lora.c TPOT ms "
          "| torch TPOT ms | paired ratio (median) |\n|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['concurrency']} | {r['adapters']} ({r['distinct_in_batch']}) | {r['base_tok_s']:.1f} | "
              f"{r['c_tok_s']:.1f} | {r['torch_tok_s']:.1f} | {r['c_tpot_ms']:.1f} | {r['torch_tpot_ms']:.1f} | "
              f"**{r['ratio_median']:.2f}x** |")


if __name__ == "__main__":
    main()
