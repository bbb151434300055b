"""The quantized KV rows of kv_quant.py in Triton: codes <-> float32 and the per-row scale.

Kernels see a quantized cache as bytes (`cache.view(torch.uint8)`) for the codes and as
float32 (`cache.view(torch.float32)`) for the scales, which sit at float index HD / 4 of
each row. Both conversions are integer bit arithmetic, so they run the same under
TRITON_INTERPRET=1 and on any GPU, and they reproduce kv_quant.quantize bit for bit
(IEEE division, round half to even). FMT: 1 int8, 2 fp8 E4M3, 3 bare E4M3 (kv_quant's format
codes; 3 reads and writes as 2 at scale 1, with no scale in the row).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import format_of

RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 to the nearest even integer


def quant_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(bytes view, float32 view, format code) of a quantized cache; (cache, cache, 0) otherwise."""
    fmt = format_of(cache)
    if fmt is None:
        return cache, cache, 0
    hd = cache.shape[-1] - fmt.scale_bytes
    if cache.shape[-1] % 4 or hd & (hd - 1):
        raise ValueError(f"quantized cache rows must be a power-of-two head_dim + {fmt.scale_bytes}, "
                         f"got {cache.shape[-1]}")
    return cache.view(torch.uint8), cache.view(torch.float32), fmt.code


@triton.jit
def decode_codes(x, FMT: tl.constexpr):
    """uint8 codes -> float32 code values (not yet times the scale)."""
    b = x.to(tl.int32)
    if FMT == 1:
        return (b - ((b & 0x80) << 1)).to(tl.float32)
    mag = b & 0x7F
    nrm = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    f = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, nrm)
    return tl.where((b & 0x80) != 0, -f, f)


@triton.jit
def encode(x, scale, FMT: tl.constexpr):
    """x [R, W] float32 with its rows' scales [R] (amax / qmax of the whole row) -> uint8 codes."""
    div = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, tl.broadcast_to(div[:, None], x.shape))
    if FMT == 1:
        r = (y + RNE_MAGIC) - RNE_MAGIC
        code = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int32) & 0xFF
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        a = tl.abs(y)
        u = a.to(tl.int32, bitcast=True)
        sub = ((a * 512.0 + RNE_MAGIC) - RNE_MAGIC).to(tl.int32)
        nrm = tl.minimum(((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - 960, 0x7E)
        code = tl.where(a < 0.015625, sub, nrm) | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    return code.to(tl.uint8)
