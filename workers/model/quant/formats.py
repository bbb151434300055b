"""Quantizers: a dense [N, K] weight -> codes and per-block scales, and back.

Every format is stored as gemm_quant.h reads GGUF blocks: for each output row n and
each block of 32 inputs kb, `w = q * d[n, kb] + m[n, kb]` (float16 d and m), so one C
tile expander serves them all:
  int8  symmetric per output channel (W8A16): d = absmax / 127 repeated over the row's
        blocks, m = 0, q in [-127, 127].
  fp8   E4M3 per output channel: d = absmax / 448, q = the E4M3 byte (decoded in the
        kernel: exact, see gemm_quant.h), m = 0.
  int4  group-wise asymmetric, groups of 32 (GGUF Q4_1's and AWQ's shape): d = (max -
        min) / 15, m = min, q in [0, 15].
The scales are rounded to float16 before the codes are chosen, so the codes are the
best for the scale the kernel will see. `gguf` is not a quantizer: it keeps a GGUF's
Q4_0/Q4_1/Q8_0 blocks as stored (the loader's job).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("int8", "fp8", "int4", "gguf")
FP8_MAX = 448.0  # largest finite E4M3 (e4m3fn) value
GROUP = 32


@dataclass(slots=True)
class QuantParts:
    """codes [N, K] (int8 for int8, uint8 for int4 and fp8), d and m [N, K/32] float16."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    method: str

    @property
    def bits(self) -> int:
        """gemm.c's format id: 4, 8 (signed int8) or FP8 (E4M3 bytes)."""
        return {"int4": 4, "int8": 8, "fp8": FP8}[self.method]

    @property
    def nbytes(self) -> int:
        code_bytes = self.codes.numel() // 2 if self.method == "int4" else self.codes.numel()
        return code_bytes + 2 * (self.d.numel() + (self.m.numel() if self.method == "int4" else 0))


FP8 = 0x108  # gemm.c's qbits for E4M3 codes (8-bit rows, its own decode)


def validate_method(method: str | None) -> str | None:
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}: choose one of {', '.join(METHODS)}")
    return method


def _per_channel(w: torch.Tensor, top: float) -> torch.Tensor:
    """float16 scale per row so that the row's absmax maps to `top` (1 for all-zero rows)."""
    amax = w.abs().amax(dim=1)
    s = (amax / top).to(torch.float16)
    s = torch.where(s > 0, s, torch.ones_like(s))  # also catches float16 underflow to 0
    return s.float()


def quantize(w: torch.Tensor, method: str) -> QuantParts:
    """`w` [N, K] (K a multiple of 32) in `method` (int8 | fp8 | int4)."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise ValueError(f"quantize: [N, K] with K a multiple of {GROUP} expected, got {tuple(w.shape)}")
    w = w.float()
    n, k = w.shape
    kb = k // GROUP
    if method in ("int8", "fp8"):
        top = 127.0 if method == "int8" else FP8_MAX
        s = _per_channel(w, top)
        x = w / s[:, None]
        if method == "int8":
            codes = x.round().clamp_(-127, 127).to(torch.int8)
        else:
            codes = x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        d = s[:, None].expand(n, kb).to(torch.float16).contiguous()
        return QuantParts(codes, d, torch.zeros_like(d), method)
    if method == "int4":
        g = w.view(n, kb, GROUP)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        d = ((hi - lo) / 15).to(torch.float16)
        m = lo.to(torch.float16)
        df = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
        q = ((g - m.float()[..., None]) / df[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        return QuantParts(q.view(n, k), d, m, method)
    raise ValueError(f"quantize: unknown method {method!r}")


def dequantize(p: QuantParts) -> torch.Tensor:
    """The float32 [N, K] the kernels compute with: q * d + m (one rounding, as gemm_quant.h's FMA)."""
    n, k = p.codes.shape
    if p.method == "fp8":
        q = p.codes.view(torch.float8_e4m3fn).float()
    else:
        q = p.codes.float()
    d = p.d.float().repeat_interleave(GROUP, dim=1)
    m = p.m.float().repeat_interleave(GROUP, dim=1)
    return torch.addcmul(m, q, d).view(n, k)
