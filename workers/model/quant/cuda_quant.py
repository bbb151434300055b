"""Quantized linear layers on CUDA: Triton dequant-GEMMs for int8 and int4, fp8 through
`torch._scaled_mm` where the device has fp8 matmuls (Hopper), a dequantizing fallback
elsewhere.

  int8  W8A16: codes int8 [N, K], one float32 scale per output channel. The kernel
        multiplies activations by the codes cast to the activation dtype (exact: |q| <=
        127) with float32 accumulation and applies the scale once per output.
  int4  group-wise: two codes a byte along K ([N, K/2] uint8), float16 d and m per 32
        inputs; each K tile is expanded (q d + m) in registers before its dot product.
  fp8   E4M3 weights [N, K] and per-channel scales. Above GEMV_MAX_ROWS rows W8A8:
        activations quantized per row (absmax / 448, one fused launch), then `_scaled_mm`
        with row-wise scales; where that raises (no fp8 GEMM on the device), the weight is
        dequantized per call instead.
  Up to GEMV_MAX_ROWS rows (decode), every method streams its codes through the GEMV
  of cuda_gemv.py (W8A16 for fp8: the activations stay exact), with the seams around it
  folded in: the MLP's [gate | up] product and its SiLU·up are one launch (`linear_silu`), the
  o and down products add into the residual stream (`linear_residual`), and the qkv and
  gate/up products normalize their input (a cuda_ops.PendingNorm) as they stream it. At
  batch 1 that leaves four launches a layer besides attention, against eight. From DENSE_MIN_ROWS rows
  (prefill) with 16-bit activations, an int8 or int4 weight is dequantized in one launch and the
  product runs on cuBLAS: the extra weight traffic costs less than a dequantizing GEMM's
  lower matmul throughput there.

Kernels run under TRITON_INTERPRET=1 on CPU tensors too (tests compare with a float64
reference). Launch grids depend on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..cuda_ops import PendingNorm, silu_mul
from .cuda_gemv import GEMV_MAX_ROWS, dequantize_weight, gemv, quantize_rows_fp8_fused
from .formats import FP8_MAX, GROUP, QuantParts


@triton.jit
def _dq_gemm_kernel(x_ptr, q_ptr, d_ptr, m_ptr, y_ptr, M, N, K, sxm, sym,
                    INT4: tl.constexpr, IEEE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[M, N] = x[M, K] @ W^T with W from int8 codes x per-channel scale (INT4 = False) or
    from int4 codes x group scale + min (INT4 = True). K is a multiple of BK."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    for k0 in range(0, K, BK):
        if INT4:
            # bytes [BN, BK/2] along K (each loaded once, coalesced); low nibbles hold the even
            # inputs, high ones the odd: two dots against x's even and odd columns
            j = tl.arange(0, BK // 2)
            b = tl.load(q_ptr + rn64[:, None] * (K // 2) + (k0 // 2 + j)[None, :], mask=mn[:, None], other=0)
            g = rn64[:, None] * (K // 32) + (k0 + 2 * j)[None, :] // 32
            d = tl.load(d_ptr + g, mask=mn[:, None], other=0.0).to(tl.float32)
            m = tl.load(m_ptr + g, mask=mn[:, None], other=0.0).to(tl.float32)
            xe = tl.load(x_ptr + rm64[:, None] * sxm + (k0 + 2 * j)[None, :], mask=mm[:, None], other=0.0)
            xo = tl.load(x_ptr + rm64[:, None] * sxm + (k0 + 2 * j + 1)[None, :], mask=mm[:, None], other=0.0)
            wlo = tl.trans(((b & 0xF).to(tl.float32) * d + m).to(xe.dtype))
            whi = tl.trans(((b >> 4).to(tl.float32) * d + m).to(xe.dtype))
            if IEEE:
                acc += tl.dot(xe, wlo, input_precision="ieee") + tl.dot(xo, whi, input_precision="ieee")
            else:
                acc += tl.dot(xe, wlo) + tl.dot(xo, whi)
        else:
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm64[:, None] * sxm + rk[None, :], mask=mm[:, None], other=0.0)
            w = tl.load(q_ptr + rn64[None, :] * K + rk[:, None], mask=mn[None, :], other=0).to(x.dtype)
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
    if not INT4:
        acc = acc * tl.load(d_ptr + rn, mask=mn, other=0.0)[None, :]
    tl.store(y_ptr + rm64[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def _tiles(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BM, BN, BK). Few rows leave a weight-streaming GEMM: narrower column blocks then keep
    ~2 programs per SM (a 4096-wide output in 64-column blocks is 64 programs)."""
    bk = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    if m > 64:
        return 64, 128, min(bk, 64)
    bm, bn = (16, 64) if m <= 16 else (32, 64)
    while bn > 16 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < 2 * sms:
        bn //= 2
    return bm, bn, bk


def dequant_gemm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 n: int, int4: bool, sms: int = 132) -> torch.Tensor:
    """x [M, K] (unit inner stride) times the quantized W [N, K] transposed, in x's dtype."""
    rows, k = x.shape
    if x.stride(1) != 1 or k % GROUP:
        raise ValueError("dequant_gemm: [M, K] rows with K a multiple of 32 expected")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        bm, bn, bk = _tiles(rows, n, k, sms)
        _dq_gemm_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
            x, q, d, d if m is None else m, y, rows, n, k, x.stride(0), y.stride(0),
            INT4=int4, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk, num_warps=4)
    return y


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic E4M3 activations: (codes [M, K] float8_e4m3fn, scales [M, 1] float32)."""
    a = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=1e-12)
    return (x.float() / a).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), a


@functools.cache
def scaled_mm_works(device: torch.device) -> bool:
    """Whether `_scaled_mm` with row-wise scales runs here (Hopper on CUDA; some CPU builds)."""
    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), torch.ones(16, 1, device=device), torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


KINDS = {"int8": 0, "int4": 1, "fp8": 2}   # cuda_gemv's KIND codes
DENSE_MIN_ROWS = 512   # from here (prefill) int8/int4 dequantize the weight for cuBLAS (fp8: fp8 matmuls)


@dataclass(slots=True)
class QuantWeight:
    """A [N, K] linear weight in `method`'s device layout; `linear(x, bias)` multiplies."""

    method: str
    n: int
    k: int
    codes: torch.Tensor             # int8 [N, K] | uint8 [N, K/2] | float8_e4m3fn [N, K]
    scale: torch.Tensor             # float32 [N] (int8, fp8) | float16 d [N, K/32] (int4)
    zero: torch.Tensor | None       # float16 m [N, K/32] (int4)
    fp8_mm: bool = False            # fp8 through _scaled_mm (else dequantized per call)
    sms: int = 132                  # the device's SMs (the GEMV sizes its grid by them)

    @classmethod
    def build(cls, p: QuantParts, device: torch.device) -> "QuantWeight":
        n, k = p.codes.shape
        device = torch.device(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        if p.method == "int4":
            c = p.codes.to(torch.uint8)
            packed = (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()
            return cls("int4", n, k, packed.to(device), p.d.to(device), p.m.to(device), sms=sms)
        scale = p.d[:, 0].float().contiguous().to(device)  # per channel: every block's d is the row's
        if p.method == "int8":
            return cls("int8", n, k, p.codes.contiguous().to(device), scale, None, sms=sms)
        codes = p.codes.view(torch.float8_e4m3fn).contiguous().to(device)
        return cls("fp8", n, k, codes, scale, None, scaled_mm_works(device), sms)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized, [N, K] in `dtype` (the fallback and the tests' reference)."""
        if self.method == "int4":
            q = torch.stack((self.codes & 0xF, self.codes >> 4), dim=-1).view(self.n, self.k).float()
            d = self.scale.float().repeat_interleave(GROUP, 1)
            return torch.addcmul(self.zero.float().repeat_interleave(GROUP, 1), q, d).to(dtype)
        return (self.codes.float() * self.scale[:, None]).to(dtype)

    def fuses(self, x) -> bool:
        """Whether rows of x (a tensor or a PendingNorm) go through the GEMV, norm and epilogues included."""
        return x.shape[0] <= GEMV_MAX_ROWS and self.k % GROUP == 0

    def _gemv(self, x, **kw) -> torch.Tensor:
        norm = None
        if isinstance(x, PendingNorm):
            x, norm = x.x, (x.w, x.eps)
        return gemv(x if x.stride(1) == 1 else x.contiguous(), self.codes, self.scale, self.zero, self.n,
                    KINDS[self.method], self.sms, norm=norm, **kw)

    def linear(self, x, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias); x may be a PendingNorm, normalized inside the GEMV at decode sizes."""
        if self.fuses(x):
            y = self._gemv(x)
            return y if bias is None else y + bias
        if isinstance(x, PendingNorm):
            x = x.materialize()
        if x.shape[0] >= DENSE_MIN_ROWS and self.method != "fp8" and x.is_cuda and x.dtype != torch.float32:
            y = F.linear(x, dequantize_weight(self.codes, self.scale, self.zero, self.n, self.k, KINDS[self.method],
                                              x.dtype))
        elif self.method == "fp8":
            if self.fp8_mm and x.dtype != torch.float32:
                xq, a = quantize_rows_fp8_fused(x if x.stride(1) == 1 else x.contiguous(), FP8_MAX)
                y = torch._scaled_mm(xq, self.codes.t(), a, self.scale[None, :], out_dtype=x.dtype)
            else:
                y = F.linear(x, self.dense(x.dtype))
        else:
            y = dequant_gemm(x if x.stride(1) == 1 else x.contiguous(), self.codes, self.scale,
                             self.zero, self.n, self.method == "int4", self.sms)
        return y if bias is None else y + bias

    def linear_silu(self, x) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] weight's product: one GEMV launch at decode sizes
        (the gate and up channels' codes side by side), else the product then cuda_ops.silu_mul."""
        return self._gemv(x, gated=True) if self.fuses(x) else silu_mul(self.linear(x))

    def linear_residual(self, x, res: torch.Tensor) -> None:
        """res += x W^T in place (the residual stream); one GEMV launch where `fuses(x)`."""
        if self.fuses(x) and res.stride(1) == 1:
            self._gemv(x, out=res)
        else:
            res.add_(self.linear(x))
