"""Prefill CUDA graphs vs eager prefill steps: TTFT per prompt length, same engine, same run.

`python3 -m kvyard.bench.gpu_prefill --out FILE.json` on a CUDA host (no install needed beyond
tools/device_gpu.sh's shim). For each model (the Llama-3-8B shape with random bf16 weights,
built in device memory; the demo model in float32 and bfloat16 where it is installed), one
engine, prefix caching off; TTFT is a one-token generate of a single prompt, so the step
timed is the prompt's prefill (a single step up to the step budget, chunks past it). Graphs
and eager alternate round by round, so drift hits both alike; medians are reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def _engine(model: Any, cfg: Any, name: str, dtype: str, budget: int, max_len: int) -> Any:
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine

    conf = EngineConfig(model=name, dtype=dtype, device="cuda", max_model_len=max_len, max_num_seqs=8,
                        kv_cache_memory_bytes=4 << 30, max_num_batched_tokens=budget,
                        enable_prefix_caching=False)
    return LLM(engine=LLMEngine(conf, model, cfg, None))


def ttft_table(llm: Any, lengths: list[int], vocab: int, rounds: int) -> dict[str, Any]:
    from kvyard.workers.engine.api import SamplingParams

    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for n in lengths:
        prompt = torch.randint(3, vocab - 1, (n,), generator=g).tolist()
        times: dict[str, list[float]] = {"graph": [], "eager": []}
        tokens: dict[str, list[int]] = {}
        for r in range(rounds + 1):  # round 0 warms both paths up
            for mode in ("graph", "eager"):
                runner.prefill_graphs = graphs if mode == "graph" else None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tok = llm.generate([prompt], params)[0].token_ids
                dt = time.perf_counter() - t0
                tokens[mode] = tok
                if r:
                    times[mode].append(dt)
        runner.prefill_graphs = graphs
        tg, te = statistics.median(times["graph"]), statistics.median(times["eager"])
        out[str(n)] = {"ttft_graph_s": tg, "ttft_eager_s": te, "speedup": te / tg,
                       "same_token": tokens["graph"] == tokens["eager"],
                       "graph_spread_s": [min(times["graph"]), max(times["graph"])],
                       "eager_spread_s": [min(times["eager"]), max(times["eager"])]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--lengths", default="128,512,2048,8192")
    p.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens (the largest graph)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--models", default="8b,demo-f32,demo-bf16")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    max_len = max(lengths) + 64
    doc: dict[str, Any] = {"card": torch.cuda.get_device_name(), "budget": args.budget, "models": {}}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        try:
            if name == "8b":
                from dataclasses import replace

                from kvyard.bench.gpu_step import config_8b, engine_model

                model, dtype = engine_model(args.layers, max_len), "bfloat16"
                cfg = replace(config_8b(max_len), num_layers=args.layers)
            else:
                from kvyard.common.models import resolve_model
                from kvyard.workers.model import load_model

                dtype = "float32" if name.endswith("f32") else "bfloat16"
                model, cfg = load_model(resolve_model("demo"), getattr(torch, dtype), max_len, device="cuda")
        except Exception as e:  # the demo model is absent until both halves of its GGUF arrived
            doc["models"][name] = {"unavailable": f"{type(e).__name__}: {e}"}
            continue
        llm = _engine(model, cfg, name, dtype, args.budget, max_len)
        entry = {"build_s": time.perf_counter() - t0, "buckets": llm.engine.runner.prefill_graphs.sizes,
                 "ttft": ttft_table(llm, [n for n in lengths if n < cfg.max_position_embeddings or name == "8b"],
                                    cfg.vocab_size, args.rounds)}
        doc["models"][name] = entry
        del llm, model
        torch.cuda.empty_cache()
        print(name, json.dumps(entry["ttft"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
