"""The engine with LoRA adapters vs the base model alone, same run, same process.

Closed-loop offline load through `LLM`-style stepping: for each concurrency (1, 8, 32)
and adapter count (1, 4, 16, each request's adapter drawn with Zipf popularity, s = 1)
the engine decodes `concurrency` requests at once; throughput is generated tokens per
second of the whole run, TPOT the mean time per output token after the first. The base
model's row is the same load with no adapter. Adapters are random rank-16 PEFT files on
q/k/v/o/gate/up/down written into a temporary directory; their load time is the
manager's (read + validate, then the first copy into a device slot).

`measure(quick)` returns the dict `kvyard bench lora` prints; `python -m
kvyard.bench.lora_engine [--quick]` prints it as JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def _zipf_names(n_adapters: int, count: int, rng: random.Random) -> list[str]:
    weights = [1.0 / (i + 1) for i in range(n_adapters)]
    return rng.choices([f"a{i}" for i in range(n_adapters)], weights=weights, k=count)


def _run(engine, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> dict:
    from kvyard.workers.engine.api import SamplingParams

    first: dict[str, float] = {}
    done: dict[str, float] = {}
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True, lora_name=n))
    tokens = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += len(o.new_token_ids)
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
    wall = time.perf_counter() - t0
    tpot = [(done[r] - first[r]) / (max_tokens - 1) for r in done if max_tokens > 1]
    return {"tok_s": tokens / wall, "tpot_ms": 1e3 * sum(tpot) / max(len(tpot), 1)}


def measure(quick: bool) -> dict:
    import torch

    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.lora.config import LoRAConfig, LoRAModule
    from kvyard.workers.lora.manager import LoRAManager
    from kvyard.workers.model import load_model

    from ._lora_files import write_adapter

    concurrencies = [1, 8] if quick else [1, 8, 32]
    adapter_counts = [1, 4] if quick else [1, 4, 16]
    max_tokens = 8 if quick else 32
    model, cfg = load_model(resolve_model("demo"), torch.float32)
    tok = load_tokenizer("demo")
    rng = random.Random(0)
    out: dict = {"model": "demo", "dtype": "float32", "rank": 16, "max_tokens": max_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as d:
        paths = [write_adapter(Path(d) / f"a{i}", cfg, rank=16, seed=i) for i in range(max(adapter_counts))]
        mods = [LoRAModule(f"a{i}", str(p)) for i, p in enumerate(paths)]
        lc = LoRAConfig(max_loras=max(adapter_counts), max_lora_rank=16,
                        max_cpu_loras=max(adapter_counts), modules=mods)
        conf = EngineConfig(dtype="float32", kv_cache_memory_bytes=256 << 20, lora=lc,
                            enable_prefix_caching=False)
        engine = LLMEngine(conf, model, cfg, tok)
        mgr: LoRAManager = engine.lora
        t0 = time.perf_counter()
        mgr.activate({"a0"}, set())
        out["adapter_load_s"] = mgr.stats.load_seconds / max(mgr.stats.loads, 1)
        out["slot_fill_s"] = time.perf_counter() - t0
        for c in concurrencies:
            prompts = [tok.encode(f"Request {i}: tell me something about number {i * 7}.") for i in range(c)]
            base = _run(engine, prompts, [None] * c, max_tokens)
            out["rows"].append({"concurrency": c, "adapters": 0, **base})
            for k in adapter_counts:
                r = _run(engine, prompts, _zipf_names(k, c, rng), max_tokens)
                out["rows"].append({"concurrency": c, "adapters": k, **r,
                                    "vs_base": r["tok_s"] / base["tok_s"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(measure(ap.parse_args().quick), indent=1))


if __name__ == "__main__":
    main()
