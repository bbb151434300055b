"""Per-request changes to a row of logits before the token is chosen: min_tokens,
logit_bias, then vLLM's three penalties, in vLLM's order.

Only rows whose request asked for one of these are touched, one row at a time:
they are rare, and the batch's common path (plain greedy or temperature
sampling) must not pay for them. Semantics follow vLLM, whose users bring the
same request bodies:
- presence / frequency penalty (OpenAI's): subtracted once per distinct output
  token / once per occurrence in the output; the prompt does not count.
- repetition penalty (vLLM's, from the CTRL paper): every token seen in the
  prompt or the output has its logit divided by it when positive, multiplied
  when negative.
- min_tokens: EOS (unless ignore_eos) and stop_token_ids get -inf until the
  output has that many tokens; stop strings are not affected (text, not ids).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .api import SamplingParams


def adjust_row(row: torch.Tensor, p: SamplingParams, token_ids: Sequence[int], num_prompt: int,
               eos_token_ids: Iterable[int]) -> None:
    """Apply `p`'s adjustments to `row` ([V] float32) in place; token_ids = prompt + output."""
    vocab = row.shape[0]
    num_output = len(token_ids) - num_prompt
    if p.min_tokens and num_output < p.min_tokens:
        ban = set(p.stop_token_ids)
        if not p.ignore_eos:
            ban.update(eos_token_ids)
        ban_ids = [t for t in ban if 0 <= t < vocab]
        if ban_ids:
            row[ban_ids] = float("-inf")
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        if ids:
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype)
    if p.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted({t for t in token_ids if 0 <= t < vocab}), dtype=torch.int64)
        v = row[seen]
        row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and num_output > 0:
        ids, counts = torch.unique(torch.tensor(token_ids[num_prompt:], dtype=torch.int64),
                                   return_counts=True)
        keep = ids < vocab
        ids, counts = ids[keep], counts[keep]
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
