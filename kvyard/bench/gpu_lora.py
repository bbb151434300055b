"""Multi-LoRA on CUDA (issue 30's `lora` keys): the engine's 8B-shape decode step with
the batch's rows spread over 1, 4 or 16 rank-16 adapters, three ways, at batch 8 and 64:
  base      the step without adapters (the engine's model, one CUDA graph);
  triton    the same step with every projection's LoRA delta from the SGMV kernel
            (workers/lora/triton_lora.py: one shrink and one expand launch per projection);
  loop      the deltas by a per-adapter torch loop (gather, two GEMMs, index_add per adapter).
Each variant is one whole step captured in one CUDA graph (the tile table is fixed-size),
timed over replays with CUDA events; random bf16 weights of Llama-3-8B's shapes.
Then greedy parity on the demo model in float32 on the GPU: two random PEFT-format
adapters and the base mixed in one batch, against HF transformers + PEFT where both
import here, else against the engine's own CPU result.

`python3 -m kvyard.bench.gpu_lora --out FILE.json` (tools/device_gpu.sh runs it with
kvyard's shim on the GPU host).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .gpu_step import DEV, DTYPE, capture, engine_model, engine_step_fn, kernel_profile, make_batch

BATCHES = (8, 64)
ADAPTERS = (1, 4, 16)
RANK = 16


def _stacks(model_cfg, slots: int):
    from kvyard.workers.lora.config import LoRAConfig
    from kvyard.workers.lora.manager import LoRAManager

    mgr = LoRAManager(LoRAConfig(max_loras=slots, max_lora_rank=RANK), model_cfg, torch.device(DEV), DTYPE)
    for layer in mgr.stacks:
        for a, b in layer.values():
            a.normal_(std=a.shape[-1] ** -0.5)
            b.normal_(std=0.01)
    return mgr.stacks


def _batches(row_slots: list[int], stacks, slots: int) -> tuple[Any, Any]:
    from kvyard.workers.lora.adapter import PROJECTIONS
    from kvyard.workers.lora.batch import LoRABatch

    projs = frozenset(PROJECTIONS)
    triton_b = LoRABatch.build(row_slots, stacks, projs, slots, torch.device(DEV))
    loop_b = LoRABatch.build(row_slots, stacks, projs, slots, torch.device("cpu"))
    loop_b.index = [i.to(DEV) for i in loop_b.index]   # the torch path, on the GPU
    return triton_b, loop_b


def _time(graph, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def decode(layers: int, ctx: int, iters: int) -> dict[str, Any]:
    model = engine_model(layers, ctx + 16)
    stacks = _stacks(model.config, max(ADAPTERS))
    out: dict[str, Any] = {}
    for bsz in BATCHES:
        b = make_batch(bsz, ctx, layers, dense=False)
        step = engine_step_fn(model, b)
        g, _ = capture(step)
        base = bsz / _time(g, iters)
        row: dict[str, Any] = {"base_tok_s": base}
        del g
        for k in ADAPTERS:
            tri, loop = _batches([i % k for i in range(bsz)], stacks, max(ADAPTERS))
            for name, lb in (("triton", tri), ("loop", loop)):
                def fn(lb=lb) -> Any:
                    return model.compute_logits(model(b.ids, b.pos, b.paged, step.meta, lora=lb))
                g, _ = capture(fn)
                tok_s = bsz / _time(g, iters)
                row[f"{name}_{k}_tok_s"] = tok_s
                row[f"{name}_{k}_vs_base"] = tok_s / base
                del g
        out[str(bsz)] = row
        del b
        torch.cuda.empty_cache()
    return out


def profile(layers: int, ctx: int, bsz: int = 64, adapters: int = 16) -> dict[str, Any]:
    """GPU time per kernel name over 3 eager steps, base and with `adapters` adapters (eager: the
    per-kernel times are what a graph replays; launch gaps are not counted)."""
    model = engine_model(layers, ctx + 16)
    stacks = _stacks(model.config, adapters)
    b = make_batch(bsz, ctx, layers, dense=False)
    step = engine_step_fn(model, b)
    tri, _ = _batches([i % adapters for i in range(bsz)], stacks, adapters)
    out: dict[str, Any] = {}
    for name, lb in (("base", None), (f"triton_{adapters}", tri)):
        def fn(lb=lb) -> Any:
            return model.compute_logits(model(b.ids, b.pos, b.paged, step.meta, lora=lb))
        out[name] = kernel_profile(fn)
        print(name, json.dumps(out[name], indent=1), flush=True)
    return out


def _greedy(engine, prompts, names, max_tokens: int) -> list[list[int]]:
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.llm import LLM

    llm = LLM(engine=engine)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, lora_name=n) for n in names]
    return [o.token_ids for o in llm.generate(prompts, params)]


def _peft_reference(paths: dict[str, Path], prompts, names, max_tokens: int) -> list[list[int]] | None:
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    from kvyard.common.models import resolve_model

    p = resolve_model("demo").path
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).to(DEV)
    first, *rest = paths
    pm = PeftModel.from_pretrained(hf, str(paths[first]), adapter_name=first)
    for n in rest:
        pm.load_adapter(str(paths[n]), adapter_name=n)
    out = []
    with torch.inference_mode():
        for ids, n in zip(prompts, names):
            x = torch.tensor([ids], device=DEV)
            kw = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                      max_new_tokens=max_tokens, pad_token_id=0)
            if n is None:
                with pm.disable_adapter():
                    y = pm.generate(**kw)
            else:
                pm.set_adapter(n)
                y = pm.generate(**kw)
            out.append(y[0, len(ids):].tolist())
    return out


def parity(max_tokens: int = 16, eager: bool = True) -> dict[str, Any]:
    """`eager` False: the GPU engine's decode steps replay CUDA graphs (cuda_lora_graphs.py)."""
    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.lora.config import LoRAConfig, LoRAModule
    from kvyard.workers.model import load_model

    from ._lora_files import write_adapter

    tok = load_tokenizer("demo")
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a short poem about the sea.")]
    with tempfile.TemporaryDirectory() as d:
        cpu_model, cfg = load_model(resolve_model("demo"), torch.float32)
        paths = {"a": write_adapter(Path(d) / "a", cfg, rank=8, std=0.1, seed=1),
                 "b": write_adapter(Path(d) / "b", cfg, rank=16, std=0.1, seed=2,
                                    modules=("q_proj", "v_proj", "down_proj"))}
        names = [n for n in ("a", "b", None) for _ in prompts]
        jobs = prompts * 3
        lc = LoRAConfig(max_loras=2, max_lora_rank=16, modules=[LoRAModule(n, str(p)) for n, p in paths.items()])

        def engine(model, device, eager=True):
            return LLMEngine(EngineConfig(dtype="float32", device=device, kv_cache_memory_bytes=256 << 20,
                                          lora=lc, enforce_eager=eager, max_num_seqs=8), model, cfg, tok)
        gpu_model, _ = load_model(resolve_model("demo"), torch.float32, device=DEV)
        gpu = engine(gpu_model, "cuda", eager)
        got = _greedy(gpu, jobs, names, max_tokens)
        lg = gpu.runner.lora_graphs
        graphs = len(lg.graphs) if lg is not None else 0
        ref = _peft_reference(paths, jobs, names, max_tokens)
        against = "peft"
        if ref is None:
            ref, against = _greedy(engine(cpu_model, "cpu"), jobs, names, max_tokens), "engine_cpu"
    same = sum(g == r for g, r in zip(got, ref))
    return {"against": against, "sequences": len(jobs), "identical": same, "parity": same == len(jobs),
            "eager": eager, "lora_graphs": graphs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--parts", default="decode,parity", help="decode, parity or both")
    ap.add_argument("--tile-from", default=None,
                    help="a gpu_lora_tune JSON: run with its suggested_tile as triton_lora.TILE")
    ap.add_argument("--profile", action="store_true",
                    help="also list the GPU time per kernel of one step, base and 16 adapters at batch 64")
    args = ap.parse_args()
    if args.tile_from:
        from kvyard.workers.lora import triton_lora

        triton_lora.TILE = triton_lora.LoRATile(*json.loads(Path(args.tile_from).read_text())["suggested_tile"]["tile"])
        print("LoRA tile:", triton_lora.TILE, flush=True)
    parts = set(args.parts.split(","))
    t0 = time.time()
    doc: dict[str, Any] = {"card": torch.cuda.get_device_name(), "layers": args.layers, "ctx": args.ctx,
                           "rank": RANK, "dtype": "bfloat16"}
    if "decode" in parts:
        doc["decode"] = decode(args.layers, args.ctx, args.iters)
    if args.profile:
        doc["profile"] = profile(args.layers, args.ctx)
    if "parity" in parts:
        doc["parity_detail"] = parity()
    doc["lora"] = {}
    if "decode" in parts:
        doc["lora"]["b64_16_adapters_vs_base"] = doc["decode"]["64"]["triton_16_vs_base"]
    if "parity" in parts:
        doc["lora"]["parity"] = doc["parity_detail"]["parity"]
    doc["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
