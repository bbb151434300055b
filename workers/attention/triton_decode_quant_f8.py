"""The "f8" quantized decode kernel: an fp8 cache read by Hopper's fp8 tensor cores, no widening.

The other variants (triton_decode_quant_fast.py) widen every code to fp16 before the dots, and
the widened tile must then cross shared memory again to reach the MMA's operand layout. Here the
codes stay E4M3 all the way into `wgmma ... e4m3.e4m3`: the keys sit on the MMA's M dimension
(scores^T [BLOCK_N, group] = K q^T, output^T [HD, group] = V^T P^T, as "bytes_t"), since with
the 16 padded query rows as M the compiler takes the fp16 mma.sync path and widens anyway.

Both other operands are made fp8 exactly enough: q and the V-weighted probabilities are each
split into a high and a low E4M3 part (x = hi + lo / 16, about 8 significant bits, bf16's
precision), so each product is two fp8 dots. Scales are powers of two, so they are exact:
- q: per query row, the largest |q| lands at 128..256;
- w = p * v_scale (the token's V scale folded into its probability, as the other variants
  do): per tile and query row, the largest w lands at 128..256 (a tile's w below 2^-17 of
  its largest is dropped: at most BLOCK_N * 2^-17 of the tile's weight).

Only the fp8 format with a 16-bit q takes this kernel (int8 and float32 q keep the others);
under TRITON_INTERPRET the same arithmetic runs on numpy, which is what the CPU tests check.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_decode_quant import program_range
from .triton_decode_quant_bytes import _finish, _rows

LO = tl.constexpr(16.0)   # the low part's multiplier: hi + lo / LO


@triton.jit
def _e4m3(x, HW: tl.constexpr):
    """x float32 -> E4M3, round to nearest even. HW: the device's convert. The interpreter's
    convert loses the carry when a mantissa rounds up into the next binade, so there x is first
    rounded to 3 mantissa bits in its own bits (exact for |x| >= 2^-6, E4M3's normal range)."""
    if not HW:
        w = x.to(tl.int32, bitcast=True)
        w = (w + 0x7FFFF + ((w >> 20) & 1)) & -0x100000
        x = w.to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _split8(x, top, HW: tl.constexpr):
    """x [R, C] float32 as two E4M3 tensors and the power-of-two column scale f: x * f = hi + lo / LO,
    the largest |x| of each column scaled into [top / 2, top)."""
    amax = tl.max(tl.abs(x), 0)
    f = tl.exp2(tl.floor(tl.log2(top / tl.where(amax > 0, amax, 1.0))))
    xs = x * f[None, :]
    hi = _e4m3(xs, HW)
    lo = _e4m3((xs - hi.to(tl.float32)) * LO, HW)
    return hi, lo, f


@triton.jit
def _codes(c_ptr, f_ptr, row, valid, HD: tl.constexpr):
    """E4M3 codes [BLOCK_N, HD] and float32 scales [BLOCK_N] of the rows at word offsets `row`."""
    d = tl.max_contiguous(tl.arange(0, HD), HD)
    off = tl.multiple_of(4 * row, 4)[:, None] + d[None, :]
    codes = tl.load(c_ptr + off, mask=valid[:, None], other=0)
    return codes.to(tl.float8e4nv, bitcast=True), tl.load(f_ptr + row + HD // 4, mask=valid, other=0.0)


@triton.jit
def decode_f8_kernel(
    q_ptr, k_ptr, v_ptr, kf_ptr, vf_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_wb, stride_wt, stride_wh,
    stride_pb, stride_ph, stride_lb, stride_lh, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, FMT: tl.constexpr,
    F16: tl.constexpr, VM: tl.constexpr, ASM: tl.constexpr,
):
    """k/v: the caches as bytes, kf/vf as float32; strides in 32-bit words (the launch's common
    signature; PREC, FMT, F16 and VM are unused: fp8 only, fp32 accumulation; ASM: on a device)."""
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + d[:, None], mask=tl.trans(gmask),
                other=0.0).to(tl.float32)                                   # q^T [HD, GP]
    qh, ql, qf = _split8(q, 256.0, ASM)
    sc_mul = scale_log2 / qf                                                  # [GP]
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([HD, GP], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        valid, row = _rows(bt_row, n0, end, kh, BS, BLOCK_N, stride_wb, stride_wt, stride_wh)
        k, ks = _codes(k_ptr, kf_ptr, row, valid, HD)
        sc = tl.dot(k, qh) + tl.dot(k, ql) * (1.0 / LO)                       # [BLOCK_N, GP]
        sc = sc * ks[:, None] * sc_mul[None, :]
        sc = tl.where(valid[:, None], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 0))
        p = tl.exp2(sc - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        v, vs = _codes(v_ptr, vf_ptr, row, valid, HD)
        wh, wl, wf = _split8(p * vs[:, None], 256.0, ASM)
        vt = tl.trans(v)
        pv = tl.dot(vt, wh) + tl.dot(vt, wl) * (1.0 / LO)                     # [HD, GP]
        acc = acc * alpha[None, :] + pv / wf[None, :]
    _finish(tl.trans(acc), m_i, l_i, b, s, g, heads, gmask, o_ptr, part_ptr, lse_ptr, stride_ob, stride_oh,
            stride_pb, stride_ph, stride_lb, stride_lh, G, HD, NUM_SPLITS, 1.0)
