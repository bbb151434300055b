"""`kvyard bench gpu --parts wake`: sleep mode's wake, to the first token, on the 8B shape.

A Llama-3-8B-shape HF directory with random bf16 weights (gpu_e2e's), loaded into an
engine on the GPU; then per level, `rounds` times: sleep, then wake and generate one
token from a 16-token prompt, timed together. The engine keeps its weights and KV cache
at fixed addresses (sleep_arena.py), so a wake maps memory back and copies the weights in
without re-capturing the decode CUDA graphs; `parts` splits each wake into its steps
(map, host-to-device copy or reload, KV map + zero) and the first token's own time. The
same run also times `--wake-plain-rounds` wakes of an engine on plain allocations (the
earlier design: per-storage copies, graphs re-captured) as the baseline. Level 2
reloads the weights from the directory, which the OS page cache holds after the first
read (a warm reload, as on a node that served the model before). The greedy tokens
after each wake must equal the ones before.
"""
from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from typing import Any


def _levels(torch, llm: Any, rounds: int, tag: str) -> dict[str, Any]:
    from kvyard.workers.engine.api import SamplingParams

    eng = llm.engine
    prompt = [list(range(100, 116))]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    eight = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = llm.generate(prompt, eight)[0].token_ids
    out: dict[str, Any] = {}
    for level in (1, 2):
        wake, sleep, wake_only, freed, parts, sleep_parts, kept = [], [], [], [], [], [], []
        for _ in range(rounds):
            torch.cuda.synchronize()
            graphs = eng.runner.graphs
            free0 = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            eng.sleep(level)
            sleep.append(time.perf_counter() - t0)
            sleep_parts.append(dict(eng._sleep.last_parts))
            freed.append((torch.cuda.mem_get_info()[0] - free0) / 2**30)
            t0 = time.perf_counter()
            eng.wake_up()
            wake_only.append(time.perf_counter() - t0)
            parts.append(dict(eng._sleep.last_parts))
            llm.generate(prompt, one)
            wake.append(time.perf_counter() - t0)
            kept.append(eng.runner.graphs is graphs and graphs is not None)
            got = llm.generate(prompt, eight)
            assert got[0].token_ids == ref, (tag, level, got[0].token_ids, ref)
        med = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in sorted({k for p in parts for k in p})}
        first_token = statistics.median(w - o for w, o in zip(wake, wake_only))
        r = dict(wake_to_first_token_s=statistics.median(wake), wake_up_s=statistics.median(wake_only),
                 first_token_s=first_token, sleep_s=statistics.median(sleep), first_sleep_s=sleep[0],
                 freed_gib=statistics.median(freed), spread_s=[min(wake), max(wake)], all_wakes_s=wake,
                 parts=med, sleep_parts=sleep_parts, graphs_kept=all(kept))
        out[str(level)] = r
        print(f"{tag} level {level}: wake to first token p50 {r['wake_to_first_token_s']:.3f} s "
              f"(wake_up {r['wake_up_s']:.3f} s = " + " + ".join(f"{k} {v:.3f}" for k, v in med.items()) +
              f"; first token {first_token:.3f} s; sleep p50 {r['sleep_s']:.3f} s, first {sleep[0]:.3f} s; "
              f"freed {r['freed_gib']:.1f} GiB; graphs kept {r['graphs_kept']})", flush=True)
    return out


def copy_probe(torch, d: str, threads: int = 8) -> dict[str, float]:
    """What a reload could cost at best: GB/s of host-to-device copies (pinned, pageable) and of
    reading the directory's safetensors files from the page cache with `threads` readers."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    out: dict[str, float] = {}
    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for name, host in (("pinned", torch.empty(n, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.ones(n, dtype=torch.uint8))):
        dev.copy_(host)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        out[f"h2d_{name}_gb_s"] = 3 * n / (time.perf_counter() - t0) / 1e9
    del dev
    files = sorted(Path(d).glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    buf = bytearray(min(total, 64 << 30))
    view = memoryview(buf)
    piece = 64 << 20
    jobs, off = [], 0
    for f in files:
        size = f.stat().st_size
        for a in range(0, size, piece):
            jobs.append((f, a, min(piece, size - a), off + a))
        off += size

    def read(job: tuple[Path, int, int, int]) -> int:
        f, a, k, o = job
        fd = os.open(f, os.O_RDONLY)
        try:
            return os.preadv(fd, [view[o:o + k]], a)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        got = sum(ex.map(read, jobs))
    out["read_page_cache_gb_s"] = got / (time.perf_counter() - t0) / 1e9
    out["read_threads"] = threads
    del view, buf
    print(f"copy probe: {out}", flush=True)
    return out


def wake_times(torch, args: argparse.Namespace) -> dict[str, Any]:
    from kvyard.bench.gpu_e2e import _hf_model
    from kvyard.common.models import resolve_model
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.model import load_model

    out: dict[str, Any] = {"layers": args.layers, "rounds": args.wake_rounds,
                           "max_num_seqs": args.wake_max_seqs}
    d = args.hf_dir or tempfile.mkdtemp(prefix="kvyard-8b-wake-", dir=args.scratch)
    try:
        if not args.hf_dir:
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
        out["load_s"] = time.perf_counter() - t0
        llm = LLM(engine=LLMEngine(conf, model, cfg, None))
        del model
        out["cold_load_and_capture_s"] = time.perf_counter() - t0
        eng = llm.engine
        out["fixed_addresses"] = eng.runner.arenas is not None
        out["weight_arena_gib"] = eng.runner.arenas.weight_bytes / 2**30 if eng.runner.arenas else None
        out.update(_levels(torch, llm, args.wake_rounds, "arenas"))
        t0 = time.perf_counter()
        eng.runner.rebuild_device_state()
        out["graph_capture_s"] = time.perf_counter() - t0
        out["probe"] = copy_probe(torch, d)
        del llm, eng
        gc.collect()   # the arenas go with the last tensor that views them
        torch.cuda.empty_cache()
        if args.wake_plain_rounds:   # the same run's baseline: plain allocations, graphs re-captured
            from unittest import mock

            from kvyard.workers.engine.sleep_arena import SleepArenas

            model, cfg = load_model(resolve_model(d), torch.bfloat16, 4096, device="cuda")
            with mock.patch.object(SleepArenas, "create", lambda *a, **k: None):   # as without the VMM API
                llm = LLM(engine=LLMEngine(conf, model, cfg, None))
            del model
            assert llm.engine.runner.arenas is None
            out["plain"] = _levels(torch, llm, args.wake_plain_rounds, "plain")
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        if not args.hf_dir:
            shutil.rmtree(d, ignore_errors=True)
    return out
