"""The HF `transformers.generate` baseline: batch 1 and one static batch.

This is what a user gets without a serving engine, so it anchors the engine's
speedups. It runs in the bench process after every server has stopped, so it
has the cores to itself. Per-token times come from a streamer hook, which
`generate` calls once with the prompt and then once per decoding step for the
whole batch; TTFT is therefore the prefill plus the first sampled token, and
in a static batch every sequence shares it.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

from kvyard.bench.client import RequestResult
from kvyard.bench.engine_client import LoadResult


class _StepClock:
    """A `BaseStreamer` that only timestamps; the first `put` is the prompt."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, value) -> None:  # noqa: ANN001 - torch tensor, torch imported lazily
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


def load(hf_dir: Path, dtype: str, threads: int):
    """(model, tokenizer); the tokenizer only turns outputs into text for the
    cross-system agreement check, outside the timed region."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype))
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(hf_dir))


def _generate(model, prompts: Sequence[Sequence[int]],
              output_len: int) -> tuple[list[float], float, list[list[int]]]:
    """One static batch; returns token timestamps, start time and each row's new tokens."""
    import torch

    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    clock = _StepClock()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=output_len, min_new_tokens=output_len, streamer=clock,
            pad_token_id=model.config.eos_token_id if model.config.pad_token_id is None
            else model.config.pad_token_id,
        )
    return clock.puts[1:], t0, out[:, ids.shape[1]:].tolist()


def run_static(model, tokenizer, prompts: Sequence[Sequence[int]], batch: int,
               output_len: int) -> LoadResult:
    """Run `prompts` in consecutive static batches of `batch`, after a short
    warm-up at the same batch shape (first calls pay allocator and kernel setup)."""
    _generate(model, list(prompts[:batch]), 2)
    results: list[RequestResult] = []
    wall = 0.0
    for i in range(0, len(prompts) - batch + 1, batch):
        group = prompts[i:i + batch]
        steps, t0, new = _generate(model, group, output_len)
        end = steps[-1] if steps else time.perf_counter()
        wall += end - t0
        ttft = steps[0] - t0 if steps else math.nan
        tpot = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else math.nan
        results += [RequestResult(ttft, tpot, len(toks), end - t0, index=i + j,
                                  text=tokenizer.decode(toks))
                    for j, toks in enumerate(new)]
    return LoadResult(batch, wall, results)
