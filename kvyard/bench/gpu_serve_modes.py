"""Online serving per mode (issue 30 §5): `python3 -m kvyard.bench.gpu_serve_modes --out FILE.json`.

One invocation, one random-weight Llama directory of the 8B shape (`--layers` of its 32; other
shapes by flag), and per mode a real `kvyard worker --device cuda` on it with that mode's flags:
  bf16        the weights as stored (the baseline)
  fp8         `--quantization fp8` (E4M3 weights, `_scaled_mm` on Hopper)
  int8 / int4 `--quantization int8|int4` (Triton dequant-GEMMs)
  kv-fp8      `--kv-cache-dtype fp8` (kv-fp8-e4m3: fp8_e4m3, kv-int8: int8)
  lora-4      `--enable-lora --max-loras 4`, four random rank-16 PEFT adapters of the model's
              shapes, requests spread over them round-robin (request `model` = adapter name)
  spec-ngram  `--speculative-config` n-gram (`--spec-config`); acceptance from the worker's
              vLLM spec-decode counters over the timed requests
At each level (`--levels`, streams) closed-loop streaming load (gpu_serve_load.py): TTFT and TPOT
p50/p99 in seconds, output tokens/s. Beside it, same run, before the worker starts: the
engine alone (gpu_serve_engine.py: the engine those flags build, no HTTP) at batch `c`.
Every prompt is one random segment (`--segment` tokens) repeated to `--prompt` tokens, fresh per
request, for every mode alike, so n-gram proposals exist while no prompt hits another's cache;
random weights decide the tokens (greedy, exactly `--new` each). `load_s` is the worker's spawn
to its first healthy /health (load, quantization, KV cache, CUDA graphs); `engine_load_s` the
in-process engine's build.

`--budget-s` bounds the whole run (device calls are limited): modes run in `--modes` order (the
default puts the most valuable first), a mode starts only with `--min-mode-s` left, and at the
deadline the running level stops sending, cuts what is in flight after a short grace and
reports what finished (`truncated`); the JSON is rewritten after every step, so what was
measured survives. `--device cpu` with a tiny shape is the CPU functional check
(tests/bench/test_gpu_serve_modes.py).

JSON: {"card", "conditions", "modes": {MODE: {"levels": {C: {"tok_s", "ttft_p50", "ttft_p99",
"tpot_p50", "tpot_p99", ...}}, "engine_tok_s": {C: ...}, "load_s", ...}}}.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvyard.bench.gpu_serve_load import Load, Prompts, run_level

MODES = ("bf16", "fp8", "kv-fp8", "lora-4", "int8", "spec-ngram", "int4", "kv-int8", "kv-fp8-e4m3")
DEFAULT_MODES = MODES[:7]      # issue 30's list, most valuable first
STATIC_FLAGS = {"bf16": [], "fp8": ["--quantization", "fp8"], "int8": ["--quantization", "int8"],
                "int4": ["--quantization", "int4"], "kv-fp8": ["--kv-cache-dtype", "fp8"],
                "kv-fp8-e4m3": ["--kv-cache-dtype", "fp8_e4m3"],
                "kv-int8": ["--kv-cache-dtype", "int8"]}
LORA_ADAPTERS = 4
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--levels", nargs="+", type=int, default=[1, 32, 128], help="concurrent streams")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time budget")
    p.add_argument("--min-mode-s", type=float, default=30.0, help="a mode starts only with this much left")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the shape (the 8B has 32)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hf-dir", default=None, help="an existing random-weight HF dir (else one is written)")
    p.add_argument("--scratch", default=None, help="where the HF dir and adapters are written")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--segment", type=int, default=64, help="prompt = a random segment this long, repeated")
    p.add_argument("--new", type=int, default=128, help="new tokens per request")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--kv-cache-memory-bytes", default=None, help="default: 16GiB on CUDA, 256MiB on CPU")
    p.add_argument("--spec-config", default=NGRAM, help="spec-ngram's --speculative-config")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine-alone baseline per mode")
    p.add_argument("--worker-args", type=shlex.split, default=[],
                   help="more `kvyard worker` flags for every mode, one string: --worker-args='--num-threads 1'")
    p.add_argument("--label", default="", help="recorded in conditions (e.g. the commit)")


def max_len(a: argparse.Namespace) -> int:
    return max(4096, a.prompt + a.new)


def model_config(a: argparse.Namespace) -> Any:
    from dataclasses import replace

    from kvyard.bench.gpu_step import config_8b

    return replace(config_8b(max_len(a)), num_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.intermediate,
                   num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads, vocab_size=a.vocab)


def write_model_dir(torch, d: Path, cfg: Any, device: str, dtype: Any) -> None:
    """config.json, random weights (RMSNorm weights 1, matrices N(0, 1/fan_in)) and the word-level
    tokenizer: a directory `kvyard worker --model` serves."""
    from safetensors.torch import save_file

    from kvyard.bench.gpu_serve import write_tokenizer
    from kvyard.bench.gpu_step import RandomSource

    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, shape in RandomSource(cfg).shapes.items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            w = torch.randn(shape, generator=g, device=device, dtype=dtype) * shape[-1] ** -0.5
            tensors[name] = w.cpu()
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch.")}))
    write_tokenizer(d, cfg.vocab_size)


def mode_flags(mode: str, a: argparse.Namespace, scratch: Path, cfg: Any) -> tuple[list[str], Callable]:
    """The worker flags of `mode` and its request index -> `model` (adapter name or None)."""
    if mode in STATIC_FLAGS:
        return list(STATIC_FLAGS[mode]), lambda i: None
    if mode == "spec-ngram":
        return ["--speculative-config", a.spec_config], lambda i: None
    from kvyard.bench._lora_files import write_adapter

    names = [f"lora{i}" for i in range(LORA_ADAPTERS)]
    for i, n in enumerate(names):
        if not (scratch / n / "adapter_config.json").exists():
            write_adapter(scratch / n, cfg, rank=a.lora_rank, alpha=a.lora_rank, seed=i)
    flags = ["--enable-lora", "--max-loras", str(LORA_ADAPTERS), "--max-lora-rank", str(a.lora_rank),
             "--lora-modules", *(f"{n}={scratch / n}" for n in names)]
    return flags, lambda i: names[i % LORA_ADAPTERS]


def spec_counts(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) from the worker's vLLM counters; (0, 0) without them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    got = {"vllm:spec_decode_num_draft_tokens_total": 0.0, "vllm:spec_decode_num_accepted_tokens_total": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in got:
                got[s.name] += s.value
    return got["vllm:spec_decode_num_draft_tokens_total"], got["vllm:spec_decode_num_accepted_tokens_total"]


class Run:
    """The run's state: arguments, deadline, the JSON document (saved after every step)."""

    def __init__(self, torch, a: argparse.Namespace, started: float) -> None:
        self.torch, self.a = torch, a
        self.deadline = started + a.budget_s
        self.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
        self.kv_bytes = a.kv_cache_memory_bytes or ("16GiB" if a.device == "cuda" else "256MiB")
        card = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        self.doc: dict[str, Any] = {"card": card, "conditions": {
            "layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate, "heads": a.heads,
            "kv_heads": a.kv_heads, "vocab": a.vocab, "dtype": self.dtype, "prompt_tokens": a.prompt,
            "segment": a.segment, "new_tokens": a.new, "requests_per_stream": a.requests_per_stream,
            "levels": a.levels, "kv_cache_memory_bytes": self.kv_bytes, "budget_s": a.budget_s,
            "label": a.label, "units": "tok_s: output tokens/s; ttft_*, tpot_*: seconds"}, "modes": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        Path(self.a.out).write_text(json.dumps(self.doc, indent=2))

    def base_flags(self, d: str) -> list[str]:
        a = self.a
        return ["--model", d, "--device", a.device, "--dtype", self.dtype, "--max-num-seqs", str(max(a.levels)),
                "--max-model-len", str(max_len(a)), "--kv-cache-memory-bytes", self.kv_bytes, *a.worker_args]

    def engine_alone(self, rec: dict[str, Any], flags: list[str], model_for: Callable) -> None:
        from kvyard.bench.gpu_serve_engine import engine_from_flags, engine_level

        a, torch = self.a, self.torch
        t0 = time.perf_counter()
        engine = engine_from_flags(flags)
        rec["engine_load_s"] = time.perf_counter() - t0
        rec["engine_tok_s"], rec["engine_detail"] = {}, {}
        try:
            for i, c in enumerate(a.levels):
                if self.left() <= 0:
                    break
                r = engine_level(engine, c, Prompts(a.vocab, a.prompt, a.segment, 1000 + i), a.new, model_for,
                                 self.deadline)
                rec["engine_tok_s"][str(c)] = r["tok_s"]
                rec["engine_detail"][str(c)] = r
                print(f"{rec['mode']} engine c={c}: {r['tok_s']:.0f} tok/s", flush=True)
                self.save()
        finally:
            del engine
            gc.collect()   # the KV arenas and graphs go with the last reference
            if a.device == "cuda":
                torch.cuda.empty_cache()

    def served(self, rec: dict[str, Any], flags: list[str], model_for: Callable, log: Path) -> None:
        from kvyard.bench import servers

        a = self.a
        w = servers.worker(flags, name=f"kvyard-{rec['mode']}", log_path=log,
                           startup_timeout_s=max(self.left(), 1.0)).start()
        rec["load_s"] = w.startup_s
        rec["levels"] = {}
        spec = rec["mode"] == "spec-ngram"
        try:
            for i, c in enumerate(a.levels):
                if self.left() <= 0:
                    break
                before = spec_counts(w.base_url) if spec else None
                r = asyncio.run(run_level(Load(w.base_url, c, a.requests_per_stream, a.new,
                                               Prompts(a.vocab, a.prompt, a.segment, i), model_for,
                                               deadline=self.deadline, grace_s=15.0)))
                if before is not None:
                    drafts, accepted = (x - y for x, y in zip(spec_counts(w.base_url), before))
                    # None: no n-gram matched, so nothing was drafted at this level
                    r.update(draft_tokens=drafts, acceptance=accepted / drafts if drafts else None)
                engine = rec.get("engine_tok_s", {}).get(str(c))
                r["vs_engine"] = r["tok_s"] / engine if engine else None
                rec["levels"][str(c)] = r
                print(f"{rec['mode']} serve c={c}: {r['tok_s']:.0f} tok/s (engine {engine or float('nan'):.0f}), "
                      f"TTFT p50/p99 {r['ttft_p50'] * 1e3:.0f}/{r['ttft_p99'] * 1e3:.0f} ms, TPOT p50/p99 "
                      f"{r['tpot_p50'] * 1e3:.1f}/{r['tpot_p99'] * 1e3:.1f} ms"
                      + (" (truncated)" if r["truncated"] else ""), flush=True)
                self.save()
        finally:
            rec["worker_exit"] = w.stop()

    def mode(self, mode: str, d: str, scratch: Path, cfg: Any) -> None:
        rec: dict[str, Any] = {"mode": mode}
        self.doc["modes"][mode] = rec
        if self.left() < self.a.min_mode_s:
            rec["skipped"] = f"time budget: {self.left():.0f} s left"
            self.save()
            return
        log = scratch / f"worker-{mode}.log"
        try:
            extra, model_for = mode_flags(mode, self.a, scratch, cfg)
            rec["flags"] = extra
            flags = self.base_flags(d) + extra
            if self.a.engine:
                self.engine_alone(rec, flags, model_for)
            if self.left() > 0:
                self.served(rec, flags, model_for, log)
                # the engine's stall log (with --worker-args "--log-level debug"): the scratch dir goes
                slow = [ln for ln in log.read_text(errors="replace").splitlines() if "slow step" in ln]
                if slow:
                    rec["slow_steps"] = slow[:20]
        except Exception as e:  # noqa: BLE001 - one mode's failure is its record; the next mode runs
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            if log.exists():
                rec["worker_log_tail"] = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            print(f"{mode}: {rec['error']}", flush=True)
        self.save()


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    p = argparse.ArgumentParser(prog="python3 -m kvyard.bench.gpu_serve_modes", description=__doc__.splitlines()[0])
    add_arguments(p)
    a = p.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_serve_modes: no CUDA device here (--device cpu for the functional check)", file=sys.stderr)
        return 2
    run = Run(torch, a, started)
    scratch = Path(tempfile.mkdtemp(prefix="kvyard-serve-modes-", dir=a.scratch))
    try:
        d = a.hf_dir
        if d is None:
            t0 = time.perf_counter()
            d = str(scratch / "model")
            write_model_dir(torch, Path(d), model_config(a), a.device, getattr(torch, run.dtype))
            if a.device == "cuda":
                torch.cuda.empty_cache()   # the workers need the card, not this process's cache
            run.doc["conditions"]["model_dir_write_s"] = time.perf_counter() - t0
        from kvyard.bench.gpu_serve import write_tokenizer
        from kvyard.workers.model.config import config_from_hf

        cfg = config_from_hf(json.loads((Path(d) / "config.json").read_text()))
        if not (Path(d) / "tokenizer.json").exists():   # a --hf-dir from `kvyard bench gpu`
            write_tokenizer(Path(d), cfg.vocab_size)
        run.doc["conditions"]["vocab"] = a.vocab = cfg.vocab_size   # prompts draw from the dir's vocabulary
        for mode in a.modes:
            run.mode(mode, d, scratch, cfg)
    finally:
        run.doc["elapsed_s"] = time.monotonic() - started
        run.save()
        shutil.rmtree(scratch, ignore_errors=True)
    summary(run.doc).emit(False)
    return 0


def summary(doc: dict[str, Any]) -> Any:
    """One row per mode and level: the server beside the engine alone (ms for latencies)."""
    from kvyard.bench.report import Report

    c = doc["conditions"]
    t = Report(f"online serving per mode, {doc['card']}, {c['layers']} layers, {c['prompt_tokens']} + "
               f"{c['new_tokens']} tokens, greedy",
               ["mode", "streams", "tok_s", "engine_tok_s", "vs_engine", "ttft_p50_ms", "ttft_p99_ms",
                "tpot_p50_ms", "tpot_p99_ms", "acceptance", "load_s", "note"])
    for mode, rec in doc["modes"].items():
        note = rec.get("skipped") or (rec.get("error") or "")[:60] or None
        levels = rec.get("levels") or {}
        for lvl in sorted(set(levels) | set(rec.get("engine_tok_s") or {}), key=int) or [None]:
            r = levels.get(lvl, {})
            t.add(mode=mode, streams=lvl, tok_s=r.get("tok_s"), engine_tok_s=(rec.get("engine_tok_s") or {}).get(lvl),
                  vs_engine=r.get("vs_engine"), acceptance=r.get("acceptance"), load_s=rec.get("load_s"),
                  note="truncated" if r.get("truncated") else note,
                  **{f"{k}_ms": 1e3 * r[k] if k in r else None for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")})
    return t


if __name__ == "__main__":
    sys.exit(main())
