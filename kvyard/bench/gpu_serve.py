"""`kvyard bench gpu --parts serve`: online serving through kvyard's own server.

A real `kvyard worker --device cuda` process (the OpenAI HTTP server, the async engine,
CUDA graphs up to `--serve-max-seqs`) on a Llama-3-8B-shape HF directory of random bf16
weights (gpu_e2e's, plus a word-level tokenizer of the model's vocabulary so the server
can detokenize), driven by an aiohttp client over loopback: at each concurrency `c`,
`c` closed-loop streams each send streaming `/v1/completions` requests back to back
(random token-id prompts of `--serve-prompt` tokens, `--serve-new` greedy tokens,
ignore_eos), `--serve-requests-per-stream` each after one warm-up request per stream.
Per request: TTFT and TPOT as `bench.client` defines them (vLLM's `bench serve`'s); per
level p50/p99 and output tokens/s over the level's wall time.

Baseline, same run, before the worker starts: the in-process engine (`LLM.generate`, no
HTTP) generating the same shape at batch `c` (fresh random prompts, so no prefix-cache
hits, all `c` admitted at once; greedy), its output tokens/s, prefill included: what the
server would reach if serving cost nothing and requests came in lockstep.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from pathlib import Path
from typing import Any

from kvyard.bench.gpu_serve_load import Load, Prompts, run_level


def write_tokenizer(d: Path, vocab: int) -> None:
    """A word-level tokenizer covering ids 0..vocab-1 ("a" is one word: the server's token-text
    anchor), so a random-weight HF directory can be served."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}))


def _level(url: str, c: int, per_stream: int, prompt_len: int, new: int, vocab: int,
           seed: int) -> dict[str, Any]:
    r = asyncio.run(run_level(Load(url, c, per_stream, new, Prompts(vocab, prompt_len, seed=seed))))
    return dict(concurrency=c, requests=r["requests"], wall_s=r["wall_s"], tok_s=r["tok_s"],
                ttft_p50_s=r["ttft_p50"], ttft_p99_s=r["ttft_p99"],
                tpot_p50_ms=1e3 * r["tpot_p50"], tpot_p99_ms=1e3 * r["tpot_p99"])


def offline_tok_s(torch, d: str, levels: list[int], prompt_len: int, new: int, max_seqs: int,
                  vocab: int) -> dict[str, float]:
    """The in-process engine at batch c: the same run's no-HTTP baseline."""
    from kvyard.common.models import resolve_model
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.model import load_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if dev == "cuda" else "float32"
    model, cfg = load_model(resolve_model(d), getattr(torch, dtype), 4096, device=dev)
    # room for every sequence of the largest batch at once (the worker has ~100 GiB): no preemption
    conf = EngineConfig(model=d, dtype=dtype, device=dev, max_model_len=4096, max_num_seqs=max_seqs,
                        kv_cache_memory_bytes=(32 << 30) if dev == "cuda" else (256 << 20))
    llm = LLM(engine=LLMEngine(conf, model, cfg, None))
    del model
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    out = {}
    for c in levels:
        llm.generate(torch.randint(4, vocab, (c, prompt_len), generator=g).tolist(), params)   # warm-up
        prompts = torch.randint(4, vocab, (c, prompt_len), generator=g).tolist()   # fresh: no prefix hits
        t0 = time.perf_counter()
        res = llm.generate(prompts, params)
        out[str(c)] = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)
    del llm
    gc.collect()   # the arenas go with the last tensor that views them
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def serve(torch, args: argparse.Namespace, d: str, device: str = "cuda") -> dict[str, Any]:
    """Start the worker on HF directory `d`, run every concurrency level, stop it."""
    from kvyard.bench import servers

    cfg = json.loads((Path(d) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    if not (Path(d) / "tokenizer.json").exists():
        write_tokenizer(Path(d), vocab)
    levels = [int(c) for c in args.serve_concurrency.split(",") if c]
    max_seqs = max(levels)
    out: dict[str, Any] = {"prompt_tokens": args.serve_prompt, "new_tokens": args.serve_new,
                           "requests_per_stream": args.serve_requests_per_stream, "max_num_seqs": max_seqs}
    out["offline_tok_s"] = offline_tok_s(torch, d, levels, args.serve_prompt, args.serve_new, max_seqs, vocab)
    print(f"serve: offline engine tok/s {out['offline_tok_s']}", flush=True)
    log = Path(d) / "worker.log"
    flags = ["--model", d, "--device", device, "--max-num-seqs", str(max_seqs), "--max-model-len", "4096",
             "--dtype", "bfloat16" if device == "cuda" else "float32"]
    if device != "cuda":
        flags += ["--kv-cache-memory-bytes", "256MiB"]
    w = servers.worker(flags + list(args.serve_worker_args or []), log_path=log,
                       startup_timeout_s=900).start()
    out["worker_start_s"] = w.startup_s
    try:
        rows = []
        for i, c in enumerate(levels):
            r = _level(w.base_url, c, args.serve_requests_per_stream, args.serve_prompt,
                       args.serve_new, vocab, seed=i)
            r["offline_tok_s"] = out["offline_tok_s"][str(c)]
            r["vs_offline"] = r["tok_s"] / r["offline_tok_s"]
            rows.append(r)
            print(f"serve c={c}: {r['tok_s']:.0f} tok/s ({r['vs_offline']:.2f} of offline "
                  f"{r['offline_tok_s']:.0f}), TTFT p50/p99 {r['ttft_p50_s'] * 1e3:.0f}/{r['ttft_p99_s'] * 1e3:.0f} ms, "
                  f"TPOT p50/p99 {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms", flush=True)
        out["levels"] = {str(r["concurrency"]): r for r in rows}
    finally:
        out["worker_exit"] = w.stop()
        out["worker_log_tail"] = w.log_tail(30)
    return out
