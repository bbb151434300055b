"""`kvyard bench gpu --parts wake`: sleep mode's wake, to the first token, on the 8B shape.

A Llama-3-8B-shape HF directory with random bf16 weights (gpu_e2e's), loaded into an
engine on the GPU; then per level, `rounds` times: sleep, then wake and generate one
token from a 16-token prompt, timed together (wake_up includes re-capturing the decode
CUDA graphs: sleep_mode.py). Level 2 reloads the weights from the directory, which the
OS page cache holds after the first read (a warm reload, as on a node that served the
model before). The greedy tokens after each wake must equal the ones before.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any


def wake_times(torch, args: argparse.Namespace) -> dict[str, Any]:
    from kvyard.bench.gpu_e2e import _hf_model
    from kvyard.common.models import resolve_model
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.model import load_model

    out: dict[str, Any] = {"layers": args.layers, "rounds": args.wake_rounds,
                           "max_num_seqs": args.wake_max_seqs}
    d = tempfile.mkdtemp(prefix="kvyard-8b-wake-", dir=args.scratch)
    try:
        t0 = time.perf_counter()
        hf = _hf_model(torch, args.layers)
        hf.save_pretrained(d, safe_serialization=True)
        del hf
        torch.cuda.empty_cache()
        out["hf_dir_write_s"] = time.perf_counter() - t0
        conf = EngineConfig(model=d, dtype="bfloat16", device="cuda", max_model_len=4096,
                            max_num_seqs=args.wake_max_seqs, kv_cache_memory_bytes=8 << 30)
        t0 = time.perf_counter()
        model, cfg = load_model(resolve_model(d), torch.bfloat16, 4096, device="cuda")
        llm = LLM(engine=LLMEngine(conf, model, cfg, None))
        del model
        out["cold_load_and_capture_s"] = time.perf_counter() - t0
        eng = llm.engine
        prompt = [list(range(100, 116))]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ref = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
        used = torch.cuda.memory_allocated()
        for level in (1, 2):
            wake, sleep, wake_only, freed = [], [], [], []
            for _ in range(args.wake_rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                eng.sleep(level)
                sleep.append(time.perf_counter() - t0)
                freed.append((used - torch.cuda.memory_allocated()) / 2**30)
                t0 = time.perf_counter()
                eng.wake_up()
                wake_only.append(time.perf_counter() - t0)
                llm.generate(prompt, one)
                wake.append(time.perf_counter() - t0)
                got = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
                assert got[0].token_ids == ref, (level, got[0].token_ids, ref)
            out[str(level)] = dict(wake_to_first_token_s=statistics.median(wake), wake_up_s=statistics.median(wake_only),
                                   sleep_s=statistics.median(sleep), freed_gib=statistics.median(freed),
                                   spread_s=[min(wake), max(wake)])
            print(f"level {level}: wake to first token p50 {out[str(level)]['wake_to_first_token_s']:.3f} s "
                  f"(wake_up {out[str(level)]['wake_up_s']:.3f} s, sleep {out[str(level)]['sleep_s']:.3f} s, "
                  f"freed {out[str(level)]['freed_gib']:.1f} GiB)", flush=True)
        t0 = time.perf_counter()
        eng.runner.rebuild_device_state()
        out["graph_capture_s"] = time.perf_counter() - t0
        del llm, eng
        torch.cuda.empty_cache()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out
