"""Weight-only quantized GEMV for decode-sized batches (a few rows) on CUDA.

At a handful of rows a quantized linear layer is a pure weight stream: time is bytes
read over HBM bandwidth, so the kernel's job is to keep enough loads in flight. The
tile GEMM (cuda_quant._dq_gemm_kernel) pads the rows to tl.dot's 16 and gives each
program 64 output channels, which leaves 64 programs for a 4096-wide output: far too
few to fill an H100/H200's 132 SMs. Here each program owns BN output channels (chosen
so the grid has several programs per SM), streams its [BN, K] slab of codes in BK-wide
tiles, widens them in registers (E4M3 by a bitcast and a hardware convert, int8 by a
cast, int4 by nibble shifts with the group's d and m) and reduces against every row of
x with multiply + sum (no tensor cores: at <= 4 rows they would idle on padding).

KIND: 0 int8 (per-channel scale), 1 int4 (two codes a byte, float16 d and m per 32
inputs), 2 fp8 E4M3 (per-channel scale). Accumulation in float32; the launch grid
depends on shapes only (CUDA-graph capturable); runs under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...attention.triton_kv_quant import encode
from .formats import GROUP

GEMV_MAX_ROWS = 4   # above this the tile GEMM (int8/int4) or fp8 matmuls (_scaled_mm) win


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, d_ptr, m_ptr, y_ptr, nw_ptr, N, K, sxm, sym, eps,
                 M: tl.constexpr, KIND: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                 RES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC2D: tl.constexpr = False):
    """y = x W^T for N output channels.
    GATED: W holds [gate | up] (2 N rows) and y = silu(gate) * up, a program streaming its
    channels' gate rows and up rows side by side (no [M, 2 N] round trip, no second launch).
    NORM: x is the residual stream and the product takes rms_norm(x) * nw, each program
    normalizing x as it streams it (x is a few KB: its sum of squares is an L2 read), so
    the norm needs no launch of its own. RES: y is the residual stream, y += x W^T in place.
    ACC2D (one row of int8 or fp8 codes, a launch the tuner may pick): `_row_acc2d`."""
    tl.static_assert(not ACC2D or M == 1)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = rn < N
    rn64 = rn.to(tl.int64)
    r0, r1, r2, r3 = 1.0, 1.0, 1.0, 1.0
    if NORM:
        r0, r1, r2, r3 = _rstd(x_ptr, K, sxm, eps, M, BK)
    g0, g1, g2, g3 = _rows_dot(x_ptr, q_ptr, d_ptr, m_ptr, nw_ptr, r0, r1, r2, r3, rn64, nmask, K, sxm,
                               M, KIND, NORM, BN, BK, ACC2D)
    s = tl.full((BN,), 1.0, tl.float32)
    if KIND != 1:
        s = tl.load(d_ptr + rn, mask=nmask, other=0.0)
    g0, g1, g2, g3 = g0 * s, g1 * s, g2 * s, g3 * s
    if GATED:
        u0, u1, u2, u3 = _rows_dot(x_ptr, q_ptr, d_ptr, m_ptr, nw_ptr, r0, r1, r2, r3, rn64 + N, nmask, K, sxm,
                                   M, KIND, NORM, BN, BK, ACC2D)
        su = tl.full((BN,), 1.0, tl.float32)
        if KIND != 1:
            su = tl.load(d_ptr + N + rn, mask=nmask, other=0.0)
        g0 = g0 * tl.sigmoid(g0) * (u0 * su)
        g1 = g1 * tl.sigmoid(g1) * (u1 * su)
        g2 = g2 * tl.sigmoid(g2) * (u2 * su)
        g3 = g3 * tl.sigmoid(g3) * (u3 * su)
    _store(y_ptr + rn, g0, nmask, RES)
    if M > 1:
        _store(y_ptr + sym + rn, g1, nmask, RES)
    if M > 2:
        _store(y_ptr + 2 * sym + rn, g2, nmask, RES)
    if M > 3:
        _store(y_ptr + 3 * sym + rn, g3, nmask, RES)


@triton.jit
def _store(ptr, v, mask, RES: tl.constexpr):
    """v rounded once to the output's dtype; RES: added to what is there first (in float32)."""
    if RES:
        v = v + tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rstd(x_ptr, K, sxm, eps, M: tl.constexpr, BK: tl.constexpr):
    """1 / rms of up to four rows of x (cuda_ops.rms_norm's arithmetic)."""
    rk = tl.arange(0, BK)
    s0 = tl.zeros((BK,), dtype=tl.float32)
    s1 = tl.zeros((BK,), dtype=tl.float32)
    s2 = tl.zeros((BK,), dtype=tl.float32)
    s3 = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        v = tl.load(x_ptr + k0 + rk).to(tl.float32)
        s0 += v * v
        if M > 1:
            v = tl.load(x_ptr + sxm + k0 + rk).to(tl.float32)
            s1 += v * v
        if M > 2:
            v = tl.load(x_ptr + 2 * sxm + k0 + rk).to(tl.float32)
            s2 += v * v
        if M > 3:
            v = tl.load(x_ptr + 3 * sxm + k0 + rk).to(tl.float32)
            s3 += v * v
    return (tl.rsqrt(tl.sum(s0, 0) / K + eps), tl.rsqrt(tl.sum(s1, 0) / K + eps),
            tl.rsqrt(tl.sum(s2, 0) / K + eps), tl.rsqrt(tl.sum(s3, 0) / K + eps))


@triton.jit
def _x(xr_ptr, nw_ptr, idx, r, NORM: tl.constexpr):
    """Inputs idx of one row of x in float32; NORM: normalized as cuda_ops.rms_norm stores them
    (times the norm weight, rounded once to x's dtype)."""
    v = tl.load(xr_ptr + idx).to(tl.float32)
    if NORM:
        v = (v * r * tl.load(nw_ptr + idx).to(tl.float32)).to(xr_ptr.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def _rows_dot(x_ptr, q_ptr, d_ptr, m_ptr, nw_ptr, r0, r1, r2, r3, rn64, nmask, K, sxm,
              M: tl.constexpr, KIND: tl.constexpr, NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              ACC2D: tl.constexpr):
    """Up to four rows of x against the quantized rows rn64 (before the per-channel scale)."""
    a0 = tl.zeros((BN,), dtype=tl.float32)
    a1 = tl.zeros((BN,), dtype=tl.float32)
    a2 = tl.zeros((BN,), dtype=tl.float32)
    a3 = tl.zeros((BN,), dtype=tl.float32)
    if KIND == 1:
        HB: tl.constexpr = BK // 2
        j = tl.arange(0, HB)
        for k0 in range(0, K, BK):
            b = tl.load(q_ptr + rn64[:, None] * (K // 2) + (k0 // 2 + j)[None, :], mask=nmask[:, None], other=0)
            lo = (b & 0xF).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
            g = rn64[:, None] * (K // 32) + (k0 + 2 * j)[None, :] // 32
            d = tl.load(d_ptr + g, mask=nmask[:, None], other=0.0).to(tl.float32)
            mn = tl.load(m_ptr + g, mask=nmask[:, None], other=0.0).to(tl.float32)
            ie, io = k0 + 2 * j, k0 + 2 * j + 1
            a0 += _int4_dot(_x(x_ptr, nw_ptr, ie, r0, NORM), _x(x_ptr, nw_ptr, io, r0, NORM), lo, hi, d, mn)
            if M > 1:
                a1 += _int4_dot(_x(x_ptr + sxm, nw_ptr, ie, r1, NORM), _x(x_ptr + sxm, nw_ptr, io, r1, NORM),
                                lo, hi, d, mn)
            if M > 2:
                a2 += _int4_dot(_x(x_ptr + 2 * sxm, nw_ptr, ie, r2, NORM),
                                _x(x_ptr + 2 * sxm, nw_ptr, io, r2, NORM), lo, hi, d, mn)
            if M > 3:
                a3 += _int4_dot(_x(x_ptr + 3 * sxm, nw_ptr, ie, r3, NORM),
                                _x(x_ptr + 3 * sxm, nw_ptr, io, r3, NORM), lo, hi, d, mn)
    else:
        if ACC2D:
            a0 = _row_acc2d(x_ptr, q_ptr, nw_ptr, r0, rn64, nmask, K, KIND, NORM, BN, BK)
        else:
            rk = tl.arange(0, BK)
            for k0 in range(0, K, BK):
                c = tl.load(q_ptr + rn64[:, None] * K + (k0 + rk)[None, :], mask=nmask[:, None], other=0)
                w = _widen(c, KIND)
                a0 += tl.sum(w * _x(x_ptr, nw_ptr, k0 + rk, r0, NORM)[None, :], axis=1)
                if M > 1:
                    a1 += tl.sum(w * _x(x_ptr + sxm, nw_ptr, k0 + rk, r1, NORM)[None, :], axis=1)
                if M > 2:
                    a2 += tl.sum(w * _x(x_ptr + 2 * sxm, nw_ptr, k0 + rk, r2, NORM)[None, :], axis=1)
                if M > 3:
                    a3 += tl.sum(w * _x(x_ptr + 3 * sxm, nw_ptr, k0 + rk, r3, NORM)[None, :], axis=1)
    return a0, a1, a2, a3


@triton.jit
def _widen(c, KIND: tl.constexpr):
    """int8 codes, or fp8 E4M3 codes held as bytes, in float32."""
    if KIND == 2:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return c.to(tl.float32)


@triton.jit
def _row_acc2d(x_ptr, q_ptr, nw_ptr, r0, rn64, nmask, K, KIND: tl.constexpr, NORM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """One row of x against byte codes, the products accumulated element-wise over the K tiles
    and reduced once after the loop instead of across warps (shuffles and a barrier) every
    tile: 132 instructions a 4 KiB tile for sm_90 against 154, for a tile of float32 registers
    more (loading the next tile ahead cost more in byte shuffles than it could hide)."""
    rk = tl.arange(0, BK)
    z = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        c = tl.load(q_ptr + rn64[:, None] * K + (k0 + rk)[None, :], mask=nmask[:, None], other=0)
        z += _widen(c, KIND) * _x(x_ptr, nw_ptr, k0 + rk, r0, NORM)[None, :]
    return tl.sum(z, axis=1)


@triton.jit
def _int4_dot(xe, xo, lo, hi, d, mn):
    """One row's partial sums over a K tile of int4 codes: even inputs meet the low nibbles."""
    return tl.sum(d * (lo * xe[None, :] + hi * xo[None, :]) + mn * (xe + xo)[None, :], axis=1)


def _block_n(n: int, sms: int) -> int:
    """The widest power-of-two channel block that still gives ~4 programs per SM (min 4)."""
    bn = 64
    while bn > 4 and triton.cdiv(n, bn) < 4 * sms:
        bn //= 2
    return bn


def _block_k(k: int, cap: int = 256) -> int:
    return next(b for b in (2048, 1024, 512, 256, 128, 64, 32) if b <= cap and k % b == 0)


# On CUDA the block shape is tuned per (N, K, rows) at the first call (Triton's autotuner,
# outside any graph capture: the runner warms every shape up first); the interpreter and the
# first guess use the static choice above.
_TUNE = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st)
         for bn, bk, w, st in ((4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3),
                               (4, 1024, 4, 2), (16, 512, 8, 3), (32, 256, 8, 3), (8, 1024, 8, 2),
                               # deeper pipelines and wider K tiles: more bytes in flight per SM at batch 1
                               (4, 1024, 4, 4), (8, 512, 4, 4), (16, 1024, 8, 2), (2, 2048, 4, 2))]


# ACC2D launches, which only one row of int8 or fp8 codes can take (_prune): four tiles of 4-16
# KiB (each configuration is one more compile at a worker's first start)
_TUNE += [triton.Config({"BN": bn, "BK": bk, "ACC2D": True}, num_warps=w, num_stages=st)
          for bn, bk, w, st in ((8, 512, 4, 3), (4, 1024, 4, 4), (16, 512, 8, 3), (16, 1024, 8, 2))]


def _prune(configs, named_args, **kwargs):
    k = named_args["K"]
    one_row = kwargs.get("M", named_args.get("M")) == 1 and kwargs.get("KIND", named_args.get("KIND")) != 1
    ok = [c for c in configs if k % c.kwargs["BK"] == 0 and (one_row or not c.kwargs.get("ACC2D"))]
    return ok or [triton.Config({"BN": 8, "BK": _block_k(k)}, num_warps=4)]


# restore_value: with RES the kernel adds into y (the residual stream) in place, so each timed
# configuration must start from the same y (tuning can happen on a live eager step)
_gemv_tuned = triton.autotune(_TUNE, key=["N", "K", "M", "KIND", "GATED", "NORM", "RES"], restore_value=["y_ptr"],
                              prune_configs_by={"early_config_prune": _prune})(_gemv_kernel)


def gemv(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, n: int,
         kind: int, sms: int = 132, gated: bool = False, norm: tuple[torch.Tensor, float] | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= GEMV_MAX_ROWS, K] (unit inner stride) times the quantized [N, K] weight, transposed.
    `gated`: the weight is [gate | up] (N = 2 I) and the result silu(gate) * up, [M, I].
    `norm` (w, eps): the product takes rms_norm(x) * w. `out`: the residual stream [M, N]
    (unit inner stride), which the product is added to in place and which is returned."""
    rows, k = x.shape
    if rows > GEMV_MAX_ROWS or x.stride(1) != 1 or k % GROUP or (gated and n % 2):
        raise ValueError("gemv: at most 4 rows with unit stride and K a multiple of 32 (gated: N even)")
    n_out = n // 2 if gated else n
    if out is not None and (out.shape != (rows, n_out) or out.stride(1) != 1):
        raise ValueError("gemv: the residual must be [M, N] rows with unit stride")
    y = torch.empty(rows, n_out, dtype=x.dtype, device=x.device) if out is None else out
    if rows:
        # uint8 codes: the kernel sees fp8 as bytes and bitcasts (the same on every device)
        q = codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes
        nw, eps = norm if norm is not None else (d, 0.0)
        args = (x, q, d, d if m is None else m, y, nw, n_out, k, x.stride(0), y.stride(0), eps)
        flags = dict(M=rows, KIND=kind, GATED=gated, NORM=norm is not None, RES=out is not None)
        if x.is_cuda:
            _gemv_tuned[lambda meta: (triton.cdiv(n_out, meta["BN"]),)](*args, **flags)
        else:
            bn = _block_n(n_out, sms)
            _gemv_kernel[(triton.cdiv(n_out, bn),)](*args, **flags, BN=bn, BK=_block_k(k), num_warps=4)
    return y


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, sxm, sqm, FP8_MAX: tl.constexpr, BK: tl.constexpr):
    """One row: absmax, then codes = x / (absmax / FP8_MAX) as E4M3 bytes."""
    r = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + r * sxm + rk, mask=rk < K, other=0.0).to(tl.float32)))
    top = tl.full((1,), tl.max(amax, 0), tl.float32)
    s = tl.max(tl.maximum(tl.math.div_rn(top, tl.full((1,), FP8_MAX, tl.float32)), 1e-12), 0)  # IEEE, as torch
    tl.store(s_ptr + r, s)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + r * sxm + rk, mask=rk < K, other=0.0).to(tl.float32)
        # the KV cache's exact round-to-nearest-even encoder (bit arithmetic, the same on every device)
        codes = encode(v[None, :], tl.full((1,), s, tl.float32), 2)
        tl.store(q_ptr + r * sqm + rk[None, :], codes, mask=(rk < K)[None, :])


def quantize_rows_fp8_fused(x: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic E4M3 activations in one launch: (codes [M, K], scales [M, 1] float32)."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quant_rows_kernel[(rows,)](x, q.view(torch.uint8), s, k, x.stride(0), q.stride(0), FP8_MAX=fp8_max,
                                    BK=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q, s


@triton.jit
def _dequant_kernel(q_ptr, d_ptr, m_ptr, w_ptr, N, K, KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """w[N, K] = the dequantized weight in w's dtype (KIND as in _gemv_kernel)."""
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    if KIND == 1:
        b = tl.load(q_ptr + rn[:, None] * (K // 2) + rk[None, :] // 2, mask=mask, other=0)
        c = ((b >> ((rk[None, :] % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        g = rn[:, None] * (K // 32) + rk[None, :] // 32
        w = c * tl.load(d_ptr + g, mask=mask, other=0.0).to(tl.float32) + tl.load(m_ptr + g, mask=mask, other=0.0)
    else:
        c = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=mask, other=0)
        w = (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) if KIND == 2 else c.to(tl.float32))
        w = w * tl.load(d_ptr + rn, mask=rn < N, other=0.0)[:, None]
    tl.store(w_ptr + rn[:, None] * K + rk[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_weight(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, n: int, k: int, kind: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype`, one launch (prefill-sized products then run on cuBLAS:
    at hundreds of rows the matmul is compute-bound and a dense GEMM beats the dequantizing one)."""
    w = torch.empty(n, k, dtype=dtype, device=codes.device)
    q = codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes
    _dequant_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 128))](q, d, d if m is None else m, w, n, k, KIND=kind,
                                                               BN=32, BK=128, num_warps=4)
    return w
