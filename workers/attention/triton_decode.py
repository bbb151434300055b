"""Paged decode attention in Triton: one query token per sequence against its block table.

- GQA: one program per (sequence, KV head, split) holds every query head of
  that KV head (padded to 16 rows, tl.dot's minimum), so each K/V row crosses
  HBM once per step instead of once per query head.
- Paging: keys are addressed per token, `block_tables[b, pos // BS] * BS +
  pos % BS`, so any block size works with any tile width and nothing is
  gathered into a copy first.
- Split-K: when batch x KV heads cannot fill the GPU, each context is cut into
  NUM_SPLITS ranges handled by separate programs; each writes its normalised
  partial output and log-sum-exp, and `_merge_kernel` combines them.
- CUDA graphs: the metadata are device tensors (seq_lens, block_tables) and the
  grid depends on shapes only, never on values, so a captured launch replays
  for any lengths up to the table's width. A sequence of length 0 (a padding
  row of a captured batch) yields zeros, never NaN.
- Quantized caches (kv_quant.py): codes are widened to q's dtype for the dots (exact:
  int8 and E4M3 values fit bf16/fp16), the K scale multiplies each key's score and
  the V scale folds into its probability before the PV product. With head_dim >= 64
  a kernel of triton_decode_quant_fast.py runs (the variant per format in its DEFAULTS,
  or the config's quant_* fields); smaller heads take the byte loads of `_decode_kernel` below.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .kv_quant import format_of, head_dim_of
from .triton_decode_bare import decode_bare, splits_for
from .triton_decode_quant import program_range
from .triton_decode_quant_fast import decode_quantized
from .triton_kv_quant import decode_codes, quant_views

LOG2E = 1.4426950408889634


@dataclass(slots=True, frozen=True)
class DecodeConfig:
    num_splits: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3   # the best single setting over the shapes timed on an H200 (docs/gpu-notes.md)
    # quantized caches (head_dim >= 64): the kernel variant and its tile, None for
    # triton_decode_quant_fast.DEFAULTS (then block_n/num_warps/num_stages above)
    quant_variant: str | None = None
    quant_block_n: int | None = None
    quant_num_warps: int | None = None
    quant_num_stages: int | None = None


def decode_config(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> DecodeConfig:
    """Enough splits for ~2 programs per SM, but never under 256 tokens per split
    (below that the merge and the per-split prologue cost more than the parallelism buys).
    Split programs walk long ranges with few programs per SM: wider key tiles keep more bytes in
    flight there (measured on an H200: 8-10% faster at batch 1-8, 10-20% slower unsplit)."""
    programs = batch * num_kv_heads
    splits = max(1, min(-(-2 * num_sms // programs), max_context // 256, 64))
    return DecodeConfig(num_splits=splits, block_n=128 if splits > 1 else 64)


@dataclass(slots=True)
class DecodeWorkspace:
    """Split-K partials, allocated once for the largest batch (persistent across graph replays)."""

    partial: torch.Tensor   # [max_batch, heads, splits, head_dim] float32
    lse: torch.Tensor       # [max_batch, heads, splits] float32, log2 units

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, num_splits: int,
                 device: torch.device | str) -> "DecodeWorkspace":
        return cls(torch.empty(max_batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
                   torch.empty(max_batch, num_heads, num_splits, dtype=torch.float32, device=device))


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch,
    stride_pb, stride_ph, stride_lb, stride_lh,
    scale_log2, kf_ptr, vf_ptr, stride_fb, stride_ft, stride_fh,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, FMT: tl.constexpr,
):
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask, other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        blk = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
        off = (blk * stride_cb + (pos % BS) * stride_ct + kh * stride_ch)[:, None] + d[None, :]
        if FMT == 0:
            k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        else:
            soff = blk * stride_fb + (pos % BS) * stride_ft + kh * stride_fh + HD // 4
            k = decode_codes(tl.load(k_ptr + off, mask=valid[:, None], other=0), FMT).to(q.dtype)
            ks = tl.load(kf_ptr + soff, mask=valid, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * (ks * scale_log2)[None, :]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FMT == 0:
            v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        else:
            v = decode_codes(tl.load(v_ptr + off, mask=valid[:, None], other=0), FMT).to(q.dtype)
            vs = tl.load(vf_ptr + soff, mask=valid, other=0.0)
            acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(q.dtype), v, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask)
    else:
        tl.store(part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * HD + d[None, :], out, mask=gmask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=g < G)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, o_ptr,
    stride_pb, stride_ph, stride_lb, stride_lh, stride_ob, stride_oh,
    HD: tl.constexpr, NUM_SPLITS: tl.constexpr, SP: tl.constexpr,
):
    """out = sum_s 2^(lse_s - max) * partial_s / sum_s 2^(lse_s - max); empty splits have lse -inf."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, HD)
    smask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * HD + d[None, :],
                   mask=smask[:, None], other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, out: torch.Tensor | None = None, config: DecodeConfig | None = None,
                 workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    """Attention of q [B, heads, head_dim] (one token per sequence, already in the cache) over the
    first seq_lens[b] tokens of each sequence's blocks. block_tables: [B, max_blocks] int32/int64;
    seq_lens: [B] int32 on q's device. Returns out [B, heads, head_dim] in q's dtype."""
    B, nh, hd = q.shape
    _, _, bs, nkv, _ = kv_cache.shape
    hd_c = head_dim_of(kv_cache)
    if hd_c != hd or nh % nkv or hd & (hd - 1) or hd < 16:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("head_dim and block tables must be contiguous")
    if block_tables.shape[0] < B or seq_lens.shape[0] < B:
        raise ValueError("one block-table row and one length per sequence")
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    cache, fcache, code = quant_views(kv_cache)
    if config is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        config = decode_config(B, nkv, block_tables.shape[1] * bs, num_sms)
        if code == 3:
            config = replace(config, num_splits=splits_for(config.num_splits, block_tables.shape[1] * bs))
    S = config.num_splits
    if S > 1 and workspace is None:
        workspace = DecodeWorkspace.allocate(B, nh, hd, S, q.device)
    if S > 1 and (workspace.partial.shape[0] < B or workspace.partial.shape[1:] != (nh, S, hd)):
        raise ValueError("workspace does not fit this batch and config")
    part = workspace.partial if S > 1 else out
    lse = workspace.lse if S > 1 else out
    g = nh // nkv
    kc, vc, kf, vf = cache[0], cache[1], fcache[0], fcache[1]
    gp = max(16, triton.next_power_of_2(g))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    if code == 3:
        decode_bare(q, kv_cache, block_tables, seq_lens, out, part, lse, scale * LOG2E, config,
                    group=g, group_pad=gp, prec=prec)
    elif code and hd >= 64:
        decode_quantized(q, kv_cache, block_tables, seq_lens, out, part, lse, scale * LOG2E, config,
                         group=g, group_pad=gp, prec=prec)
    else:
        _decode_kernel[(B, nkv, S)](
            q, kc, vc, block_tables, seq_lens, out, part, lse,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            kc.stride(0), kc.stride(1), kc.stride(2),
            part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
            scale * LOG2E, kf, vf, kf.stride(0), kf.stride(1), kf.stride(2),
            G=g, GP=gp, HD=hd, BS=bs, BLOCK_N=config.block_n, NUM_SPLITS=S, PREC=prec, FMT=code,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if S > 1:
        _merge_kernel[(B, nh)](
            part, lse, out, part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), HD=hd, NUM_SPLITS=S, SP=triton.next_power_of_2(S),
            num_warps=4,
        )
    return out
