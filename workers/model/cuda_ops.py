"""The decoder's CUDA linear ops: cuBLAS GEMMs with Triton kernels at the seams between them.

Why these two kernels: at batch 1-64 an 8B decode step is GEMVs plus a few hundred
small kernels. torch's residual add + RMSNorm is two passes and a few launches per
norm (65 norms a step), and SiLU(gate) * up is three; each fused kernel here is one
pass. Measured on the H200 (`kvyard bench gpu`, docs/gpu-notes.md): +5-8 points of the
HBM roofline on the whole step.

Numerics: sums and the norm in float32, one rounding to the activation dtype at the
end of each (torch rounds the add, then the normed value, then its product with the
weight). In float32 that is HF's arithmetic up to summation order.

Kernels run under TRITON_INTERPRET=1 on CPU tensors too (tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .linear_ops import TorchOps


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    """ADD: res += x (stored rounded to res's dtype), out = rms_norm(res) * w; else out = rms_norm(x) * w."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < N
    h = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    if ADD:
        h = h + tl.load(res_ptr + row * stride_r + c, mask=m, other=0.0).to(tl.float32)
        h = h.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + c, h, mask=m)
        h = h.to(tl.float32)
    y = h * tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (w * y).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    """out = silu(gu[:, :N]) * gu[:, N:], in float32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(gu_ptr + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + N + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (g / (1 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=m)


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm of rows x [T, H] (unit inner stride)."""
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(t,)](x, x, w, out, x.stride(0), x.stride(0), out.stride(0), eps,
                               N=n, BLOCK=block, ADD=False, num_warps=_warps(block))
    return out


def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """res += x in place (the residual stream); returns rms_norm(res) * w. Rows [T, H]."""
    t, n = res.shape
    if x.shape != res.shape or res.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("add_rms_norm: [T, H] rows of one shape expected")
    out = torch.empty((t, n), dtype=res.dtype, device=res.device)
    if t:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(t,)](x, res, w, out, x.stride(0), res.stride(0), out.stride(0), eps,
                               N=n, BLOCK=block, ADD=True, num_warps=_warps(block))
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] rows [T, 2 I] -> [T, I]."""
    t, n2 = gu.shape
    n = n2 // 2
    if gu.stride(1) != 1 or n2 % 2:
        raise ValueError("silu_mul: [T, 2 I] rows expected")
    out = torch.empty((t, n), dtype=gu.dtype, device=gu.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gu, out, gu.stride(0), out.stride(0), N=n, BLOCK=block,
                                                     num_warps=4)
    return out


@dataclass(slots=True)
class PendingNorm:
    """rms_norm(x) * w not yet computed: a quantized weight's GEMV normalizes x as it streams it
    (quant/cuda_gemv.py's NORM), anything else materializes it first."""

    x: torch.Tensor
    w: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def materialize(self) -> torch.Tensor:
        return rms_norm(self.x, self.w, self.eps)


def _dense(x) -> torch.Tensor:
    return x.materialize() if isinstance(x, PendingNorm) else x


def linear(x, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for dense weights; a quantized one (quant/cuda_quant.QuantWeight) multiplies itself."""
    return F.linear(_dense(x), w, bias) if isinstance(w, torch.Tensor) else w.linear(x, bias)


def gate_up_silu(x, w) -> torch.Tensor:
    """silu(gate) * up of x times the [gate | up] weight (a quantized weight fuses the two)."""
    return silu_mul(F.linear(_dense(x), w)) if isinstance(w, torch.Tensor) else w.linear_silu(x)


def _fused_residual(w, x, bias) -> bool:
    """Whether w's product over x adds itself into the residual stream (quantized, decode-sized)."""
    return bias is None and not isinstance(w, torch.Tensor) and w.fuses(x)


class CudaOps(TorchOps):
    """Weights on the GPU: F.linear (cuBLAS) for every dense matrix (quantized ones: their
    own kernels, quant/cuda_quant.py), the residual add
    inside the next RMSNorm (`add_rms_norm`), SiLU*up in one pass. RoPE: with
    `rope_in_attention` the layer hands q/k unrotated to the attention backend, whose KV
    write rotates them (the loader gives it the tables); else torch from the table.
    Every op's launch depends on shapes only (CUDA-graph capturable)."""

    def __init__(self, cfg, rope_in_attention: bool = True) -> None:
        super().__init__(cfg, None)
        self.rope_in_attention = rope_in_attention
        eps = cfg.rms_norm_eps
        self.eps = eps
        self.norm = lambda x, w: rms_norm(x, w, eps)
        self.linear = linear

    def rope(self, positions, table, t):
        if not self.rope_in_attention:
            return super().rope(positions, table, t)
        cfg = self.cfg
        nh, nkv, hd, qk_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size + cfg.kv_size
        return lambda qkv: qkv[:, :qk_size].view(t, nh + nkv, hd)

    def mlp_add(self, h, lw, x):
        return x + linear(gate_up_silu(h, lw.gate_up), lw.down)

    def o_add_norm(self, o, lw, x):
        if _fused_residual(lw.o, o, lw.o_bias):   # x += o Wo^T inside the GEMV; its norm waits for gate/up
            x = x if x.is_contiguous() else x.contiguous()
            lw.o.linear_residual(o, x)
            return x, PendingNorm(x, lw.post_norm, self.eps)
        return self.add_norm(linear(o, lw.o, lw.o_bias), x, lw.post_norm)

    def silu_mul(self, gu):
        return silu_mul(gu)

    def add_norm(self, y, x, w):
        if w is None:
            return x + y, None
        if not x.is_contiguous():
            x = x.contiguous()
        return x, add_rms_norm(y, x, w, self.eps)   # x += y in place (the residual stream)

    def mlp_add_norm(self, h, lw, x, next_norm):
        a = gate_up_silu(h, lw.gate_up)
        if _fused_residual(lw.down, a, None):   # the next layer's qkv GEMV applies its norm
            x = x if x.is_contiguous() else x.contiguous()
            lw.down.linear_residual(a, x)
            return x, None if next_norm is None else PendingNorm(x, next_norm, self.eps)
        return self.add_norm(linear(a, lw.down), x, next_norm)
