"""Prefill/extend attention in Triton: each sequence's new tokens, causally, against its whole
context in the paged cache (cached prefix + the new tokens, already written there).

One kernel serves fresh prompts, prefix-cache hits and chunked prefill alike:
new token i of sequence b sits at position `seq_lens[b] - n_new + i` and sees
every key at or before it; where the keys came from does not matter. Metadata
are cu_seqlens-style device tensors (`query_start_loc` [B+1], `seq_lens` [B],
`block_tables` [B, max_blocks]). The grid is (heads, ceil(max_query_len /
BLOCK_M), B): heads vary fastest, so the query heads sharing a KV head run
side by side and re-read its tiles from L2, and tiles past a sequence's end
exit at once; nothing depends on values, so the launch is graph-capturable
for a fixed max_query_len.

Keys below the tile's first query position are visible to every row of the
tile and run without a mask; only the last BLOCK_M + BLOCK_N keys or so go
through the causal mask. A quantized cache is read as triton_decode.py reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kv_quant import head_dim_of
from .triton_kv_quant import decode_codes, quant_views

LOG2E = 1.4426950408889634


@dataclass(slots=True, frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3


def prefill_config(head_dim: int, max_query_len: int | None = None) -> PrefillConfig:
    """head_dim 128: the fastest of six tilings on an H200 for 2k-8k prompts and 4k-prefix extends
    (docs/gpu-notes.md). Smaller heads: half-width key tiles (not yet timed).
    A few new tokens per sequence (speculative verify steps, short extends) get query tiles of
    16-32 rows: a 128-row tile would compute and hold 8-32x more rows than exist, and with
    float32 (no tensor cores) its registers spill; on an H200 a verify step of 5 queries per row
    took ~1.2 ms a layer that way."""
    if max_query_len is not None and max_query_len <= 32:
        return PrefillConfig(block_m=max(16, 1 << (max_query_len - 1).bit_length()), block_n=64, num_warps=4)
    return PrefillConfig() if head_dim >= 128 else PrefillConfig(block_n=64, num_warps=4)


@triton.jit
def _tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, n0, qpos, seq_len, kv_head_off, scale_log2,
          stride_cb, stride_ct, d, kf_ptr, vf_ptr, stride_fb, stride_ft, f_head_off,
          BS: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
          HD: tl.constexpr, FMT: tl.constexpr):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N."""
    pos = n0 + tl.arange(0, BLOCK_N)
    in_seq = pos < seq_len
    blk = tl.load(bt_row + pos // BS, mask=in_seq, other=0).to(tl.int64)
    off = (blk * stride_cb + (pos % BS) * stride_ct + kv_head_off)[:, None] + d[None, :]
    if FMT == 0:
        k = tl.load(k_ptr + off, mask=in_seq[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    else:
        soff = blk * stride_fb + (pos % BS) * stride_ft + f_head_off + HD // 4
        k = decode_codes(tl.load(k_ptr + off, mask=in_seq[:, None], other=0), FMT).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if FMT == 3:   # bare E4M3 codes (fp8_e4m3): no scale
            qk = qk * scale_log2
        else:
            qk = qk * (tl.load(kf_ptr + soff, mask=in_seq, other=0.0) * scale_log2)[None, :]
    if MASK:
        qk = tl.where((pos[None, :] <= qpos[:, None]) & in_seq[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FMT == 0:
        v = tl.load(v_ptr + off, mask=in_seq[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    else:
        v = decode_codes(tl.load(v_ptr + off, mask=in_seq[:, None], other=0), FMT).to(q.dtype)
        if FMT != 3:
            p = p * tl.load(vf_ptr + soff, mask=in_seq, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, lens_ptr, o_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch,
    scale_log2, kf_ptr, vf_ptr, stride_fb, stride_ft, stride_fh,
    G: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, FMT: tl.constexpr,
):
    h = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.load(qsl_ptr + b)
    n_new = tl.load(qsl_ptr + b + 1) - q_start
    if m0 >= n_new:
        return
    seq_len = tl.load(lens_ptr + b)
    prefix = seq_len - n_new
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = (rows < n_new)[:, None]
    qpos = prefix + rows
    d = tl.arange(0, HD)
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rmask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    kv_head_off = (h // G) * stride_ch
    f_head_off = (h // G) * stride_fh
    full_end = (prefix + m0) // BLOCK_N * BLOCK_N   # keys < prefix + m0: visible to every row
    kv_end = tl.minimum(seq_len, prefix + m0 + BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, n0, qpos, seq_len, kv_head_off,
                              scale_log2, stride_cb, stride_ct, d, kf_ptr, vf_ptr, stride_fb, stride_ft,
                              f_head_off, BS, BLOCK_N, False, PREC, HD, FMT)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, n0, qpos, seq_len, kv_head_off,
                              scale_log2, stride_cb, stride_ct, d, kf_ptr, vf_ptr, stride_fb, stride_ft,
                              f_head_off, BS, BLOCK_N, True, PREC, HD, FMT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rmask)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  max_query_len: int | None = None, out: torch.Tensor | None = None,
                  config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal attention of q [T, heads, head_dim] (sequence b's new tokens are rows
    query_start_loc[b]:query_start_loc[b+1], their K/V already in the cache) over each sequence's
    first seq_lens[b] tokens. max_query_len bounds the new tokens of any one sequence (default T:
    always safe, a host int so no sync is needed). Returns out [T, heads, head_dim]."""
    T, nh, hd = q.shape
    _, _, bs, nkv, _ = kv_cache.shape
    hd_c = head_dim_of(kv_cache)
    B = seq_lens.shape[0]
    if hd_c != hd or nh % nkv or hd & (hd - 1) or hd < 16:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("head_dim and block tables must be contiguous")
    if query_start_loc.shape[0] != B + 1 or block_tables.shape[0] < B:
        raise ValueError("query_start_loc must be [B+1], block_tables [>=B, max_blocks]")
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    max_q = T if max_query_len is None else max_query_len
    config = config or prefill_config(hd, max_q)
    cache, fcache, code = quant_views(kv_cache)
    kc, vc, kf, vf = cache[0], cache[1], fcache[0], fcache[1]
    grid = (nh, triton.cdiv(max_q, config.block_m), B)
    _prefill_kernel[grid](
        q, kc, vc, block_tables, query_start_loc, seq_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        scale * LOG2E, kf, vf, kf.stride(0), kf.stride(1), kf.stride(2),
        G=nh // nkv, HD=hd, BS=bs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", FMT=code,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
