"""How much a quantized KV cache changes the model's predictions, measured in process.

For each prompt, the unquantized engine's greedy continuation is the reference text;
every engine then reads prompt + that continuation in one prefill (teacher forcing,
so a single early flip cannot derail the rest of the comparison) and its next-token
distributions at the continuation's positions are compared with the reference's:
top-1 agreement (the argmax tokens are equal) and mean KL(reference || quantized).
The prefill reads K/V back from the cache for every query, so each position sees the
quantized context exactly as a decode would. Also: how many greedy tokens the free-running
outputs share before the first difference.

Used by tests/workers/test_kv_dtype.py and `python -m kvyard.workers.engine.kv_quant_eval`
(the numbers in docs/kv-cache-dtype.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvyard.workers.attention import AttentionMetadata

from .api import SamplingParams
from .config import EngineConfig
from .llm import LLM

QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Tell me a story about a dragon who learns to bake bread in a small mountain village.",
    "Explain in detail how a bicycle works, covering the frame, the wheels, the chain and the brakes.",
    "Why is the sky blue? Answer like a physics teacher talking to curious twelve year olds.",
    "What are three tips for writing clean Python code?",
    "Translate 'good morning' into Spanish, French and German.",
    "Summarise the plot of Romeo and Juliet in five sentences.",
)


@dataclass(slots=True)
class Agreement:
    kv_cache_dtype: str
    positions: int              # teacher-forced positions compared
    top1_agreement: float       # share of positions whose argmax matches the reference's
    mean_kl: float              # mean KL(reference || this), nats
    max_kl: float
    greedy_common_prefix: list[int]   # free-running: tokens equal to the reference before the first difference
    kv_bytes_per_token: int


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of one fresh prefill through the engine's model and
    KV cache. Writes blocks 0.. of the cache: only for an idle engine without prefix caching
    (`eval_engine`), whose blocks hold nothing between requests."""
    if llm.engine.block_manager.enable_prefix_caching:
        raise ValueError("teacher forcing overwrites cache blocks: use an engine without prefix caching")
    runner = llm.engine.runner
    n, bs = len(token_ids), runner.block_size
    nb = -(-n // bs)
    if nb > runner.num_blocks:
        raise ValueError("sequence longer than the KV cache")
    dev = runner.device
    meta = AttentionMetadata(slot_mapping=torch.arange(n, dtype=torch.int64, device=dev), query_start_loc=[0, n],
                             seq_lens=[n], block_tables=torch.arange(nb, dtype=torch.int64, device=dev)[None, :],
                             num_decodes=0)
    hidden = runner.model.forward(torch.tensor(token_ids, dtype=torch.int64, device=dev),
                                  torch.arange(n, device=dev), runner.kv_caches, meta)
    return runner.model.compute_logits(hidden).float().cpu()


def eval_engine(kv_cache_dtype: str, model: str = "demo", dtype: str = "auto") -> LLM:
    return LLM(EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, seed=0,
                            enable_prefix_caching=False))


def kv_bytes_per_token(llm: LLM) -> int:
    c = llm.engine.runner.kv_caches
    return c[0][:, 0, 0].numel() * c[0].element_size() * len(c)


def prompts_of(llm: LLM, questions=QUESTIONS) -> list[list[int]]:
    tok = llm.engine.tokenizer
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [o.token_ids for o in outs]


def compare(ref: LLM, other: LLM, name: str, prompts: list[list[int]], max_tokens: int) -> Agreement:
    ref_out = greedy(ref, prompts, max_tokens)
    other_out = greedy(other, prompts, max_tokens)
    agree = total = 0
    kls: list[torch.Tensor] = []
    for p, cont in zip(prompts, ref_out):
        seq = p + cont
        lo = len(p) - 1   # the logits at position i predict token i + 1
        a = torch.log_softmax(teacher_forced_logits(ref, seq)[lo:len(seq) - 1], -1)
        b = torch.log_softmax(teacher_forced_logits(other, seq)[lo:len(seq) - 1], -1)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        kls.append((a.exp() * (a - b)).sum(-1))
    kl = torch.cat(kls)
    prefix = [next((i for i, (x, y) in enumerate(zip(r, o)) if x != y), min(len(r), len(o)))
              for r, o in zip(ref_out, other_out)]
    return Agreement(name, total, agree / max(total, 1), float(kl.mean()), float(kl.max()), prefix,
                     kv_bytes_per_token(other))


def decode_tpot_ms(llm: LLM, prompt: list[int], tokens: int = 64) -> float:
    """Mean time per output token of one greedy request at concurrency 1 (the prefill excluded)."""
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))   # warm
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t1 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / tokens * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="KV-cache dtype accuracy and speed on a model (default: demo)")
    p.add_argument("--model", default="demo")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5, help="decode timings: rounds, engines interleaved")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--kv-dtypes", nargs="+", default=["int8", "fp8", "fp8_e4m3"], help="compared with auto")
    args = p.parse_args(argv)
    engines = {d: eval_engine(d, args.model, args.dtype) for d in ("auto", *args.kv_dtypes)}
    prompts = prompts_of(engines["auto"])
    rows = []
    for d, llm in engines.items():
        row = asdict(compare(engines["auto"], llm, d, prompts, args.max_tokens))
        row["kv_blocks"] = llm.engine.runner.num_blocks
        rows.append(row)
    # interleaved, so that load from other processes falls on every engine alike
    tpot: dict[str, list[float]] = {d: [] for d in engines}
    for _ in range(args.rounds):
        for d, llm in engines.items():
            tpot[d].append(decode_tpot_ms(llm, prompts[2]))
    for row in rows:
        row["decode_tpot_ms_c1_median"] = round(statistics.median(tpot[row["kv_cache_dtype"]]), 2)
        row["decode_tpot_ms_c1_best"] = round(min(tpot[row["kv_cache_dtype"]]), 2)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
