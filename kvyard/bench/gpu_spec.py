"""Speculative decoding on CUDA: `python3 -m kvyard.bench.gpu_spec --out FILE.json`.

Runs on the GPU host without kvyard installed (tools/device_gpu.sh's shim; docs/gpu-notes.md):
the demo model on CUDA, n-gram lookup and a draft model (the demo's first `--draft-layers`
layers) against no speculation, at batch 1 and 8, per workload of `kvyard bench spec`
(kvyard/bench/data/spec/), paired rounds in alternating order, greedy; verify steps replay
CUDA graphs. Writes issue 30's `spec` keys: {WORKLOAD: {"speedup_b1", "speedup_b8",
"acceptance"}} for n-gram, every mode's detail under "modes", and whether the greedy tokens
were unchanged.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m kvyard.bench.gpu_spec")
    p.add_argument("--out", required=True)
    p.add_argument("--modes", default="none,ngram,ngram-auto,draft,draft-auto")
    p.add_argument("--workloads", default="code,repetitive,qa,creative")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts-b1", type=int, default=3)
    p.add_argument("--draft-layers", type=int, default=10)
    p.add_argument("--dtype", default="float32", help="float32 keeps greedy tokens comparable bit for bit")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (decode and verify)")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a functional check of this script)")
    p.add_argument("--profile", default="", help="a mode to run once more under torch.profiler at batch 1 "
                   "(its top operators by CPU and CUDA time go to the JSON's \"profile\")")
    a = p.parse_args(argv)

    import torch

    from kvyard.bench.spec_run import batch_prompts, load_prompts, make_engine, mode_configs, measure, paired
    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.model import load_model

    t0 = time.time()
    modes = [m for m in a.modes.split(",") if m]
    configs = mode_configs(a.draft_layers)
    tok = load_tokenizer("demo")
    model, cfg = load_model(resolve_model("demo"), getattr(torch, a.dtype), 2048, device=a.device)
    engines = {m: make_engine((model, cfg, tok), configs[m], a.dtype, a.device, enforce_eager=a.eager,
                              kv_cache_memory_bytes=(1 << 30) if a.device == "cuda" else 64 << 20, max_model_len=2048, max_num_seqs=8)
               for m in modes}
    result = {"card": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "dtype": a.dtype, "graphs": not a.eager,
              "max_tokens": a.max_tokens, "rounds": a.rounds, "draft_layers": a.draft_layers,
              "spec": {}, "modes": {}}
    for w in a.workloads.split(","):
        prompts = load_prompts(tok, w)
        rows = {}
        for b in (1, 8):
            ps = batch_prompts(prompts, b, a.prompts_b1)
            for m in modes:  # every engine's first steps (kernel compiles, lazy captures) before timing
                measure(engines[m], ps[:b], b, 16)
            rows[b] = paired(engines, modes, ps, b, a.max_tokens, a.rounds)
            print(f"# {w} b{b}: " + ", ".join(f"{m} {rows[b][m]['speedup']:.2f}x (accept {rows[b][m]['acceptance']}, "
                                             f"same tokens {rows[b][m]['same_tokens']})" for m in modes), flush=True)
        result["modes"][w] = {f"b{b}": r for b, r in rows.items()}
        main_mode = "ngram" if "ngram" in modes else modes[-1]
        result["spec"][w] = {"speedup_b1": rows[1][main_mode]["speedup"],
                             "speedup_b8": rows[8][main_mode]["speedup"],
                             "acceptance": rows[1][main_mode]["acceptance"],
                             "greedy_unchanged": all(r[m]["same_tokens"] for r in rows.values() for m in modes)}
        _write(a.out, result, t0)   # after every workload: a call's time limit keeps what ran
    if a.profile:
        result["profile"] = profile_mode(engines[a.profile], load_prompts(tok, a.workloads.split(",")[0])[:1],
                                         a.max_tokens)
    _write(a.out, result, t0)
    print(json.dumps(result["spec"], indent=2))
    return 0


def _write(path: str, result: dict, t0: float) -> None:
    result["elapsed_s"] = round(time.time() - t0, 1)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def profile_mode(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, str]:
    """One generation under torch.profiler: where a mode's step time goes."""
    from torch.profiler import ProfilerActivity, profile

    from kvyard.bench.spec_run import measure

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.config.device == "cuda" else [])
    with profile(activities=acts) as prof:
        m = measure(engine, prompts, 1, max_tokens)
    avg = prof.key_averages()
    return {"tok_s": f"{m.tok_s:.1f}",
            "by_cpu": avg.table(sort_by="self_cpu_time_total", row_limit=25),
            "by_cuda": avg.table(sort_by="self_cuda_time_total", row_limit=25) if len(acts) > 1 else ""}


if __name__ == "__main__":
    sys.exit(main())
