"""Quantized KV-cache formats (`--kv-cache-dtype int8|fp8|fp8_e4m3`): what a cache row holds and
the torch definition of writing and reading it.

A quantized cache keeps the engine's one-tensor-per-layer layout, `[2, num_blocks,
block_size, kv_heads, head_dim + 4]`, in a one-byte dtype (torch.int8, or
torch.float8_e4m3fn for fp8): each (token, kv head) row is `head_dim` codes followed by
its float32 scale's 4 bytes. The scale travels inside the row, so everything that moves
whole blocks (prefix caching, kv_blocks.gather/scatter, the kvstore, P/D pulls) carries
it with no extra plumbing, and the tensor's dtype says which format it is.

Scales are per token and KV head: `scale = amax(|row|) / qmax` (qmax 127 for int8, 448 for
E4M3), `code = round(x / scale)` (round half to even; fp8 saturates at 448), `x' = code *
scale`. Per token rather than per block because a token's write then never touches another
token (no re-quantizing a block when a larger value arrives, no read-modify-write under
CUDA graphs), at 4 bytes per row: 68 bytes per 64-dim row (0.53x bf16), 132 per 128-dim
row (0.52x). The C kernels (cpu_ops/paged_attention_q8.h) and the Triton ones quantize and
dequantize by this exact definition; these functions are the reference they are tested
against and the CPU fallback when no compiler is available.

`fp8_e4m3` is vLLM's fp8 cache instead: bare E4M3 codes, one per value, no scale (a
per-tensor scale of 1, as vLLM without calibrated scales), `code = e4m3(clamp(x, +-448))`.
Rows are exactly half of bf16's and 16-byte aligned, which is what lets the GPU's decode
kernel read them at 0.82x its bf16 byte rate on an H100, against 0.57x for the scaled rows
(docs/gpu-notes.md); E4M3's own exponent covers typical K/V ranges, so dropping the scale
costs little precision. Its tensor dtype is torch.uint8 (the bytes), so the dtype still names
the format. On the CPU it runs through `write` and `attend` below: the C kernels read scaled
rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

from .reference import dense_attention

if TYPE_CHECKING:
    from kvyard.kvstore.layout import KVLayout

SCALE_BYTES = 4


@dataclass(slots=True, frozen=True)
class KVFormat:
    name: str               # the flag's value: int8 | fp8 | fp8_e4m3
    dtype: torch.dtype      # the cache tensor's dtype
    qmax: float             # largest code magnitude
    code: int               # the kernels' format id
    scale_bytes: int = SCALE_BYTES   # after each row's codes (0: no scale)


INT8 = KVFormat("int8", torch.int8, 127.0, 1)
FP8 = KVFormat("fp8", torch.float8_e4m3fn, 448.0, 2)
FP8_E4M3 = KVFormat("fp8_e4m3", torch.uint8, 448.0, 3, 0)
_BY_NAME = {"int8": INT8, "fp8": FP8, "fp8_e4m3": FP8_E4M3}
_BY_DTYPE = {INT8.dtype: INT8, FP8.dtype: FP8, FP8_E4M3.dtype: FP8_E4M3}
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")


def resolve_kv_format(name: str) -> KVFormat | None:
    """The format for `--kv-cache-dtype` (None for auto: the model's dtype, unquantized)."""
    if name == "auto":
        return None
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}: {', '.join(KV_CACHE_DTYPES)}") from None


def format_of(cache: torch.Tensor) -> KVFormat | None:
    """The quantized format a cache tensor holds, None for a plain float cache."""
    return _BY_DTYPE.get(cache.dtype)


def cache_shape(shape: tuple[int, ...], fmt: KVFormat | None) -> tuple[int, ...]:
    """A layer's cache shape for `fmt`: the scale's bytes widen each row."""
    return shape if fmt is None else (*shape[:-1], shape[-1] + fmt.scale_bytes)


def head_dim_of(cache: torch.Tensor) -> int:
    fmt = format_of(cache)
    return cache.shape[-1] - (fmt.scale_bytes if fmt else 0)


def block_layout(cache: torch.Tensor, num_layers: int) -> "KVLayout":
    """The kvstore layout of one block of `num_layers` caches shaped like `cache`."""
    from kvyard.kvstore.layout import KVLayout   # here: the GPU bench imports this module without xxhash

    fmt = format_of(cache)
    return KVLayout(str(cache.dtype).removeprefix("torch."), int(cache.shape[2]), num_layers,
                    int(cache.shape[3]), head_dim_of(cache), fmt.scale_bytes if fmt else 0)


def copyable(cache: torch.Tensor) -> torch.Tensor:
    """A view of `cache` that index_select/index_copy_ take on every device (torch has no
    float8 index_copy_ on the CPU): fp8 caches move as their bytes."""
    return cache.view(torch.uint8) if cache.dtype == FP8.dtype else cache


def row_bytes(head_dim: int, fmt: KVFormat | None, elem_bytes: int) -> int:
    """Bytes one (token, kv head) row of K or V takes."""
    return head_dim * elem_bytes if fmt is None else head_dim + fmt.scale_bytes


def quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> rows [..., head_dim + scale bytes] as uint8."""
    xf = x.float()
    if fmt.scale_bytes == 0:
        return xf.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = xf.abs().amax(-1, keepdim=True) / fmt.qmax
    y = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    if fmt is INT8:
        codes = y.round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat((codes, scale.contiguous().view(torch.uint8)), -1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [..., head_dim + scale bytes] of a quantized cache, in its dtype -> values
    [..., head_dim] in `dtype`."""
    fmt = format_of(rows)
    if fmt is None:
        raise ValueError(f"not a quantized KV row tensor: {rows.dtype}")
    b = rows.view(torch.uint8)
    if fmt.scale_bytes == 0:
        return b.view(torch.float8_e4m3fn).to(dtype)
    hd = b.shape[-1] - SCALE_BYTES
    scale = b[..., hd:].contiguous().view(torch.float32)
    codes = b[..., :hd].contiguous().view(fmt.dtype).float()
    return (codes * scale).to(dtype)


def write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot] = quantize(k), quantize(v) (slots < 0 are skipped)."""
    fmt = format_of(kv_cache)
    _, nb, bs, nkv, w = kv_cache.shape
    slots = kv_cache.view(torch.uint8).view(2, nb * bs, nkv, w)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots[0].index_copy_(0, slot_mapping, quantize(k, fmt))
    slots[1].index_copy_(0, slot_mapping, quantize(v, fmt))


def attend(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
           block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged attention over a quantized cache in torch, one sequence at a time: its blocks
    are dequantized to float32 and attended densely (the slow, obviously-right path)."""
    _, _, bs, nkv, _ = kv_cache.shape
    out = torch.empty_like(q)
    for i, ctx in enumerate(seq_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        blocks = block_tables[i, :-(-ctx // bs)].to(torch.int64)
        rows = kv_cache.view(torch.uint8)[:, blocks].reshape(2, -1, nkv, kv_cache.shape[-1])[:, :ctx]
        kv = dequantize(rows.view(kv_cache.dtype))
        out[s:e] = dense_attention(q[s:e], kv[0], kv[1], ctx - (e - s), scale)
    return out

