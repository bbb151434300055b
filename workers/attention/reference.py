"""Slow, obviously-correct pieces for tests and debugging: a dense attention
reference and a metadata builder for hand-made batches.

Kept next to the backend so every backend (CPU now, Triton later) is checked
against the same definition of "right".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import AttentionMetadata


@dataclass(slots=True)
class SeqStep:
    """One sequence's part in a step: its blocks, tokens already cached, tokens new now."""

    block_ids: list[int]
    num_cached: int
    num_new: int


def build_metadata(seqs: list[SeqStep], block_size: int, num_decodes: int) -> AttentionMetadata:
    """The engine's batch layout for `seqs` (decodes first, as the contract requires)."""
    if any(s.num_new != 1 for s in seqs[:num_decodes]):
        raise ValueError("decodes carry exactly one new token")
    slots: list[int] = []
    qsl = [0]
    for s in seqs:
        for pos in range(s.num_cached, s.num_cached + s.num_new):
            slots.append(s.block_ids[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + s.num_new)
    width = max(len(s.block_ids) for s in seqs)
    bt = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        bt[i, :len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int64)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=[s.num_cached + s.num_new for s in seqs],
        block_tables=bt,
        num_decodes=num_decodes,
    )


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                    scale: float) -> torch.Tensor:
    """q: [n, nh, hd] new tokens; k, v: [num_cached + n, nkv, hd] the whole context.
    Query i sits at position num_cached + i and sees keys 0..num_cached + i. float32 math."""
    n, nh, _ = q.shape
    rep = nh // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    ctx = k.shape[0]
    allowed = torch.arange(ctx)[None, :] <= (torch.arange(n) + num_cached)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)
