"""Paged attention on CPU in plain torch.

Per layer: scatter the new K/V into their slots (one `index_copy_` each),
then one batched SDPA for all decodes (each sequence's blocks gathered by
`block_tables`, padding masked by `seq_lens`) and one SDPA per prefill chunk
(its new tokens see every cached token and, causally, each other). The
gather indices and masks depend only on the step, so the first layer builds
them into `meta.scratch` and the other layers reuse them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import AttentionMetadata

_KEY = "torch_cpu"


@dataclass(slots=True)
class _Chunk:
    """One prefill chunk: new tokens q[start:end] against the sequence's first `ctx` tokens."""

    start: int
    end: int
    ctx: int
    blocks: torch.Tensor | None     # block ids to gather; None when nothing was cached before
    mask: torch.Tensor | None       # [n, ctx] bool, True = may attend; None = plain causal


@dataclass(slots=True)
class _StepPlan:
    num_decodes: int
    dec_blocks: torch.Tensor | None  # [nd * nb] block ids, row-major per sequence
    dec_nb: int
    dec_mask: torch.Tensor | None    # [nd, 1, 1, nb*bs] bool
    chunks: list[_Chunk]


def _plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    nd = meta.num_decodes
    qsl, lens, bt = meta.query_start_loc, meta.seq_lens, meta.block_tables
    dec_blocks = dec_mask = None
    nb = 0
    if nd:
        longest = max(lens[:nd])
        nb = -(-longest // block_size)
        dec_blocks = bt[:nd, :nb].reshape(-1)
        dec_len = torch.tensor(lens[:nd], dtype=torch.int64)
        dec_mask = (torch.arange(nb * block_size) < dec_len[:, None]).view(nd, 1, 1, -1)
    chunks = []
    for i in range(nd, len(lens)):
        s, e, ctx = qsl[i], qsl[i + 1], lens[i]
        n = e - s
        cached = ctx - n
        if cached == 0:
            chunks.append(_Chunk(s, e, ctx, None, None))
            continue
        blocks = bt[i, :-(-ctx // block_size)]
        mask = torch.arange(ctx)[None, :] <= torch.arange(cached, ctx)[:, None]
        chunks.append(_Chunk(s, e, ctx, blocks, mask))
    return _StepPlan(nd, dec_blocks, nb, dec_mask, chunks)


class TorchCPUBackend:
    """`AttentionBackend` for CPU tensors (float32 or bfloat16)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _, num_blocks, block_size, nkv, hd = kv_cache.shape
        plan = meta.scratch.get(_KEY)
        if plan is None:
            plan = meta.scratch[_KEY] = _plan(meta, block_size)
        slots = kv_cache.view(2, num_blocks * block_size, nkv, hd)
        slots[0].index_copy_(0, meta.slot_mapping, k)
        slots[1].index_copy_(0, meta.slot_mapping, v)

        nd = plan.num_decodes
        if nd and not plan.chunks:
            return self._decode(q, kv_cache, plan, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, plan, scale)
        for c in plan.chunks:
            out[c.start:c.end] = self._prefill(q[c.start:c.end], k[c.start:c.end], v[c.start:c.end],
                                               kv_cache, c, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, scale: float) -> torch.Tensor:
        nd, nh, hd = q.shape
        nkv = kv_cache.shape[3]
        kv = kv_cache[:, plan.dec_blocks].view(2, nd, -1, nkv, hd).transpose(2, 3)  # [2, nd, nkv, S, hd]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=plan.dec_mask,
                                           scale=scale, enable_gqa=nh != nkv)
        return o.view(nd, nh, hd)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 c: _Chunk, scale: float) -> torch.Tensor:
        n, nh, hd = q.shape
        nkv = kv_cache.shape[3]
        qh = q.transpose(0, 1).unsqueeze(0)
        if c.blocks is None:
            o = F.scaled_dot_product_attention(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               is_causal=True, scale=scale, enable_gqa=nh != nkv)
        else:
            kv = kv_cache[:, c.blocks].view(2, -1, nkv, hd)[:, :c.ctx].transpose(1, 2)  # [2, nkv, ctx, hd]
            o = F.scaled_dot_product_attention(qh, kv[0:1], kv[1:2], attn_mask=c.mask,
                                               scale=scale, enable_gqa=nh != nkv)
        return o[0].transpose(0, 1)
