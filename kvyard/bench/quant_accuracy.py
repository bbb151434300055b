"""Accuracy of a weight/KV format for `kvyard bench quant`.

In process (the model alone): next-token distributions over fixed windows of the shipped
text, compared with the bf16 model's: top-1 agreement and mean KL(bf16 || mode), the way
llama.cpp's `--kl-divergence` compares a quantization with its base.

Through kvyard's own API (the engine with its KV cache dtype): perplexity of the text and
a multiple-choice task scored by loglikelihood, as lm-eval-harness scores one: each
choice's continuation tokens summed from `/v1/completions` with `echo` and `logprobs`
(acc) and divided by its length in characters (acc_norm).
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

DATA = Path(__file__).with_name("data")
TEXT = DATA / "coriolanus_act1.txt"   # Shakespeare, Coriolanus act 1 (public domain), ~4,100 tokens
MC = DATA / "quant_mc.jsonl"          # 48 four-way questions written for this bench


def text_windows(tok, window: int, count: int | None) -> list[list[int]]:
    """The text's tokens in consecutive windows of `window` (the first `count`)."""
    ids = tok.encode(TEXT.read_text())
    wins = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    return wins[:count] if count else wins


def mc_items() -> list[dict[str, Any]]:
    return [json.loads(line) for line in MC.read_text().splitlines() if line.strip()]


def window_logprobs(model, cfg, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """log_softmax of the logits at every position of one prefill of `ids` (float32, on the CPU),
    run on the model's device."""
    from kvyard.workers.attention.reference import SeqStep, build_metadata
    from kvyard.workers.model import kv_cache_shape

    n = len(ids)
    blocks = list(range(-(-n // block_size)))
    dev = model.device
    caches = [torch.zeros(kv_cache_shape(cfg, len(blocks), block_size), dtype=model.dtype, device=dev)
              for _ in range(cfg.num_layers)]
    meta = build_metadata([SeqStep(blocks, 0, n)], block_size, 0)
    with torch.inference_mode():
        h = model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), caches, meta)
        return torch.log_softmax(model.compute_logits(h), -1).cpu()


@dataclass(slots=True)
class Divergence:
    agreement: float  # share of positions whose argmax equals the reference's
    kl: float         # mean KL(reference || this) in nats


def divergence(ref: list[torch.Tensor], got: list[torch.Tensor]) -> Divergence:
    same = total = 0
    kl = 0.0
    for r, g in zip(ref, got, strict=True):
        same += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += r.shape[0]
        kl += float((r.exp() * (r - g)).sum())
    return Divergence(same / total, kl / total)


def _body(model: str, ids: Sequence[int]) -> dict[str, Any]:
    return {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
            "echo": True, "logprobs": 1}


async def _prompt_logprobs(base_url: str, model: str, prompts: list[list[int]], concurrency: int
                           ) -> list[list[float]]:
    """Each prompt's tokens' logprobs (the first token has none) from the completions API."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def one(session, ids: list[int]) -> list[float]:
        async with sem, session.post(f"{base_url}/v1/completions", json=_body(model, ids)) as r:
            body = await r.json()
            if r.status != 200:
                raise RuntimeError(f"completions {r.status}: {body}")
        lps = body["choices"][0]["logprobs"]["token_logprobs"]
        return [float(v) for v in lps[1:len(ids)]]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        return list(await asyncio.gather(*(one(session, p) for p in prompts)))


def api_perplexity(base_url: str, model: str, windows: list[list[int]]) -> float:
    lps = asyncio.run(_prompt_logprobs(base_url, model, windows, 4))
    flat = [v for w in lps for v in w]
    return math.exp(-sum(flat) / len(flat))


@dataclass(slots=True)
class McScore:
    acc: float
    acc_norm: float
    n: int


def mc_requests(tok, items: list[dict[str, Any]]) -> tuple[list[list[int]], list[int]]:
    """Per (item, choice): context + continuation ids and the continuation's token count
    (lm-eval's split: the whole encoded, the context's own encoding as the boundary)."""
    prompts, conts = [], []
    for it in items:
        ctx = f"Question: {it['question']}\nAnswer:"
        n_ctx = len(tok.encode(ctx))
        for c in it["choices"]:
            ids = tok.encode(f"{ctx} {c}")
            prompts.append(ids)
            conts.append(len(ids) - n_ctx)
    return prompts, conts


def api_multiple_choice(base_url: str, model: str, tok, items: list[dict[str, Any]]) -> McScore:
    prompts, conts = mc_requests(tok, items)
    lps = asyncio.run(_prompt_logprobs(base_url, model, prompts, 8))
    acc = acc_norm = 0
    k = 0
    for it in items:
        scores, norms = [], []
        for c in it["choices"]:
            s = sum(lps[k][-conts[k]:])
            scores.append(s)
            norms.append(s / max(1, len(c) + 1))
            k += 1
        acc += int(max(range(len(scores)), key=scores.__getitem__) == it["answer"])
        acc_norm += int(max(range(len(norms)), key=norms.__getitem__) == it["answer"])
    return McScore(acc / len(items), acc_norm / len(items), len(items))
