"""The "bytes" and "bytes_t" quantized decode kernels (triton_decode_quant_fast.py chooses and
launches them) and the pieces every variant there shares: tile rows, the online softmax step,
the dot dtype, the split's log-sum-exp.

"bytes" loads the codes as one [BLOCK_N, head_dim] uint8 tile (4-byte alignment hinted, so the
loads vectorise to 32 bits), widens the whole tile natively (fp8 -> fp16 is
`cvt.rn.f16x2.e4m3x2` on sm_89+) and runs ONE dot per K and V tile, as the bf16 kernel does.
"bytes_t" (TRANS) puts the keys on the MMA's M dimension: scores [BLOCK_N, group] = K q^T and
output^T = V^T P^T, since with the 16 query rows as M Hopper's wgmma (M >= 64 per warp group)
is out of reach.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_decode_quant import program_range


@triton.jit
def _dot_dtype(x, F16: tl.constexpr):
    if F16:
        x = x.to(tl.float16)
    return x


@triton.jit
def _rows(bt_row, n0, end, kh, BS: tl.constexpr, BLOCK_N: tl.constexpr, stride_wb, stride_wt, stride_wh):
    """The tile's validity and each row's offset, in the strides' units (words here, bytes for the bare kernel)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    blk = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
    return valid, blk * stride_wb + (pos % BS) * stride_wt + kh * stride_wh


@triton.jit
def _online(qk, valid, m_i, l_i):
    """One tile of the online softmax over scores [group, keys] (log2 units)."""
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_lse(lse_ptr, b, s, g, heads, m_i, l_i, stride_lb, stride_lh, G: tl.constexpr):
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=g < G)


@triton.jit
def _tile(c_ptr, f_ptr, row, valid, HD: tl.constexpr, FMT: tl.constexpr, dt: tl.constexpr):
    """Codes [BLOCK_N, HD] widened to dt and scales [BLOCK_N] of the rows at word offsets `row`
    (c_ptr: the cache as bytes, f_ptr: as float32)."""
    d = tl.max_contiguous(tl.arange(0, HD), HD)
    off = tl.multiple_of(4 * row, 4)[:, None] + d[None, :]
    codes = tl.load(c_ptr + off, mask=valid[:, None], other=0)
    scale = tl.load(f_ptr + row + HD // 4, mask=valid, other=0.0)
    if FMT == 1:
        return codes.to(tl.int8, bitcast=True).to(dt), scale
    return codes.to(tl.float8e4nv, bitcast=True).to(dt), scale


@triton.jit
def _finish(acc, m_i, l_i, b, s, g, heads, gmask, o_ptr, part_ptr, lse_ptr,
            stride_ob, stride_oh, stride_pb, stride_ph, stride_lb, stride_lh,
            G: tl.constexpr, HD: tl.constexpr, NUM_SPLITS: tl.constexpr, VM: tl.constexpr):
    """acc [group, HD] (V scales times VM) normalised into out, or a split's partial and lse."""
    d = tl.arange(0, HD)
    out = acc / (tl.where(l_i > 0, l_i, 1.0) * VM)[:, None]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask)
    else:
        tl.store(part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * HD + d[None, :], out, mask=gmask)
        _store_lse(lse_ptr, b, s, g, heads, m_i, l_i, stride_lb, stride_lh, G)


@triton.jit
def decode_bytes_kernel(
    q_ptr, k_ptr, v_ptr, kf_ptr, vf_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_wb, stride_wt, stride_wh,
    stride_pb, stride_ph, stride_lb, stride_lh, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, FMT: tl.constexpr,
    F16: tl.constexpr, VM: tl.constexpr, ASM: tl.constexpr, TRANS: tl.constexpr = False,
):
    """k/v: the caches as bytes, kf/vf as float32; strides in 32-bit words. TRANS ("bytes_t"):
    scores as [keys, group] and the accumulator as [HD, group]."""
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    d = tl.arange(0, HD)
    q = _dot_dtype(tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask, other=0.0),
                   F16)
    qt = tl.trans(q)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    if TRANS:
        acc = tl.zeros([HD, GP], tl.float32)
    else:
        acc = tl.zeros([GP, HD], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        valid, row = _rows(bt_row, n0, end, kh, BS, BLOCK_N, stride_wb, stride_wt, stride_wh)
        k, ks = _tile(k_ptr, kf_ptr, row, valid, HD, FMT, q.dtype)
        if TRANS:
            sc = tl.dot(k, qt, input_precision=PREC) * (ks * scale_log2)[:, None]
            sc = tl.where(valid[:, None], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 0))
            p = tl.exp2(sc - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
            v, vs = _tile(v_ptr, vf_ptr, row, valid, HD, FMT, q.dtype)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), (p * (vs * VM)[:, None]).to(q.dtype),
                                                input_precision=PREC)
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * (ks * scale_log2)[None, :]
            p, alpha, m_i, l_i = _online(qk, valid, m_i, l_i)
            v, vs = _tile(v_ptr, vf_ptr, row, valid, HD, FMT, q.dtype)
            acc = acc * alpha[:, None] + tl.dot((p * (vs * VM)[None, :]).to(q.dtype), v, input_precision=PREC)
    if TRANS:
        acc = tl.trans(acc)
    _finish(acc, m_i, l_i, b, s, g, heads, gmask, o_ptr, part_ptr, lse_ptr, stride_ob, stride_oh,
            stride_pb, stride_ph, stride_lb, stride_lh, G, HD, NUM_SPLITS, VM)
