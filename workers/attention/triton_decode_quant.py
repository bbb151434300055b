"""Paged decode attention over a quantized KV cache (kv_quant.py's rows), read as 32-bit words.

A quantized row is head_dim code bytes then a float32 scale (head_dim + 4 bytes), so
rows are only 4-byte aligned: loading them as bytes issues one narrow load per element,
which leaves the kernel far from HBM bandwidth. Here each row is loaded as head_dim / 4
int32 words (coalesced, 4 codes per load), and byte i of word j, the code of dimension
4j + i, is taken out with a shift. The dimensions are thereby split into 4 interleaved
slices; attention is a sum over dimensions for q.k and a per-dimension product for p.V,
so each slice is its own pair of dots against q's matching slice and its own output
slice, and nothing is shuffled back: q is loaded and the output stored with stride 4.
E4M3 codes widen through a bitcast and the device's converter, int8 codes by a cast.

Same program layout (`program_range`, shared with triton_decode.py's kernel), split-K
partials and CUDA-graph rules as triton_decode.py (which owns the merge kernel and the
dispatch); needs head_dim / 4 >= 16 (tl.dot's minimum).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_range(lens_ptr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """This program's sequence b, KV head kh, split s and its context range [start, end) (scalars
    only, so the Gluon kernel calls it too)."""
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * per_split
    return b, kh, s, start, tl.minimum(seq_len, start + per_split)


@triton.jit
def program_range(lens_ptr, G: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """split_range's values and this program's query heads (g, heads, gmask: the group padded
    to GP rows)."""
    b, kh, s, start, end = split_range(lens_ptr, BLOCK_N, NUM_SPLITS)
    g = tl.arange(0, GP)
    return b, kh, s, start, end, g, kh * G + g, (g < G)[:, None]


@triton.jit
def _widen(w, i: tl.constexpr, FMT: tl.constexpr, dtype: tl.constexpr):
    """Byte i of each int32 word as the code's value in `dtype` (the scale is applied apart)."""
    if FMT == 1:
        return ((w << (24 - 8 * i)) >> 24).to(dtype)   # arithmetic shift: the signed byte
    b = ((w >> (8 * i)) & 0xFF).to(tl.uint8)
    return b.to(tl.float8e4nv, bitcast=True).to(dtype)


@triton.jit
def _qk(q0, q1, q2, q3, w, FMT: tl.constexpr, PREC: tl.constexpr):
    dt = q0.dtype
    s = tl.dot(q0, tl.trans(_widen(w, 0, FMT, dt)), input_precision=PREC)
    s += tl.dot(q1, tl.trans(_widen(w, 1, FMT, dt)), input_precision=PREC)
    s += tl.dot(q2, tl.trans(_widen(w, 2, FMT, dt)), input_precision=PREC)
    s += tl.dot(q3, tl.trans(_widen(w, 3, FMT, dt)), input_precision=PREC)
    return s


@triton.jit
def _store_slices(ptr, o0, o1, o2, o3, d4, mask):
    tl.store(ptr + 4 * d4[None, :], o0, mask=mask)
    tl.store(ptr + 4 * d4[None, :] + 1, o1, mask=mask)
    tl.store(ptr + 4 * d4[None, :] + 2, o2, mask=mask)
    tl.store(ptr + 4 * d4[None, :] + 3, o3, mask=mask)


@triton.jit
def decode_quant_kernel(
    q_ptr, kw_ptr, vw_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_wb, stride_wt, stride_wh,
    stride_pb, stride_ph, stride_lb, stride_lh, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, FMT: tl.constexpr,
):
    """kw/vw: the K and V caches as 32-bit words ([blocks, BS, kv_heads, HD/4 + 1], the last
    word of a row its float32 scale); strides in words."""
    W: tl.constexpr = HD // 4
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    d4 = tl.arange(0, W)
    qrow = q_ptr + b * stride_qb + heads[:, None] * stride_qh + 4 * d4[None, :]
    q0 = tl.load(qrow, mask=gmask, other=0.0)
    q1 = tl.load(qrow + 1, mask=gmask, other=0.0)
    q2 = tl.load(qrow + 2, mask=gmask, other=0.0)
    q3 = tl.load(qrow + 3, mask=gmask, other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, W], tl.float32)
    a1 = tl.zeros([GP, W], tl.float32)
    a2 = tl.zeros([GP, W], tl.float32)
    a3 = tl.zeros([GP, W], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        blk = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
        row = blk * stride_wb + (pos % BS) * stride_wt + kh * stride_wh
        off = row[:, None] + d4[None, :]
        kw = tl.load(kw_ptr + off, mask=valid[:, None], other=0)
        ks = tl.load(kw_ptr + row + W, mask=valid, other=0).to(tl.float32, bitcast=True)
        qk = _qk(q0, q1, q2, q3, kw, FMT, PREC) * (ks * scale_log2)[None, :]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vw = tl.load(vw_ptr + off, mask=valid[:, None], other=0)
        vs = tl.load(vw_ptr + row + W, mask=valid, other=0).to(tl.float32, bitcast=True)
        pv = (p * vs[None, :]).to(q0.dtype)
        dt = q0.dtype
        a0 = a0 * alpha[:, None] + tl.dot(pv, _widen(vw, 0, FMT, dt), input_precision=PREC)
        a1 = a1 * alpha[:, None] + tl.dot(pv, _widen(vw, 1, FMT, dt), input_precision=PREC)
        a2 = a2 * alpha[:, None] + tl.dot(pv, _widen(vw, 2, FMT, dt), input_precision=PREC)
        a3 = a3 * alpha[:, None] + tl.dot(pv, _widen(vw, 3, FMT, dt), input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        t = o_ptr.dtype.element_ty
        _store_slices(o_ptr + b * stride_ob + heads[:, None] * stride_oh, (a0 / l_safe).to(t), (a1 / l_safe).to(t),
                      (a2 / l_safe).to(t), (a3 / l_safe).to(t), d4, gmask)
    else:
        _store_slices(part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * HD, a0 / l_safe, a1 / l_safe,
                      a2 / l_safe, a3 / l_safe, d4, gmask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=g < G)
