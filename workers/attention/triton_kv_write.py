"""KV write by slot mapping in Triton, optionally with RoPE applied on the way.

One program per new token copies its K and V rows (all KV heads) to
`slot = block_id * block_size + offset` of the paged cache (layout in
`__init__`). A slot of -1 writes nothing: a CUDA graph captured for a batch
of N pads shorter batches with such tokens, so the launch never depends on
values. `rope_write_kv` also rotates q in place and k before it is stored
(HF rotate-half RoPE from a cos/sin table indexed by position): the step
then runs one kernel where RoPE on q and k plus two scatters took five or
more.

A quantized cache (kv_quant.py) gets codes and a scale per (token, kv head) row:
the row's amax is taken after RoPE, over both halves (triton_kv_quant.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import format_of, head_dim_of
from .triton_kv_quant import encode, quant_views


@triton.jit
def _rotate(x1, x2, cos, sin):
    """Rotate-half RoPE on the two halves of a row block, in float32."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_q8(c_ptr, cf_ptr, dst, fdst, x1, x2, hmask, j, W: tl.constexpr, HD: tl.constexpr,
              QMAX: tl.constexpr, FMT: tl.constexpr):
    """Codes of one row given as two halves of width W (x2 None-like when W == HD), then its scale
    (FMT 3, bare E4M3: the codes alone, at scale 1)."""
    # IEEE division (a GPU's `/` is approximate): the scale must be kv_quant.quantize's bit for bit
    if FMT == 3:
        one = tl.full([x1.shape[0]], 1.0, tl.float32)
        tl.store(c_ptr + dst + j, encode(x1, one, 2), mask=hmask)
        if W != HD:
            tl.store(c_ptr + dst + W + j, encode(x2, one, 2), mask=hmask)
    elif W == HD:
        amax = tl.max(tl.abs(x1), 1)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        tl.store(c_ptr + dst + j, encode(x1, scale, FMT), mask=hmask)
    else:
        amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
        scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        tl.store(c_ptr + dst + j, encode(x1, scale, FMT), mask=hmask)
        tl.store(c_ptr + dst + W + j, encode(x2, scale, FMT), mask=hmask)
    if FMT != 3:
        tl.store(cf_ptr + fdst + HD // 4, scale[:, None], mask=hmask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    q_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_qt, stride_qh, stride_cos, stride_sin,
    kcf_ptr, vcf_ptr, stride_fb, stride_ft, stride_fh,
    NKV: tl.constexpr, NKV_P: tl.constexpr, NH: tl.constexpr, NH_P: tl.constexpr,
    HD: tl.constexpr, BS: tl.constexpr, ROPE: tl.constexpr, QMAX: tl.constexpr, FMT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, NKV_P)
    hmask = (h < NKV)[:, None] & (slot >= 0)
    dst = (slot // BS) * stride_cb + (slot % BS) * stride_ct + h[:, None] * stride_ch
    fdst = (slot // BS) * stride_fb + (slot % BS) * stride_ft + h[:, None] * stride_fh
    k_row = k_ptr + t * stride_kt + h[:, None] * stride_kh
    v_row = v_ptr + t * stride_vt + h[:, None] * stride_vh
    if ROPE:
        HALF: tl.constexpr = HD // 2
        j = tl.arange(0, HALF)[None, :]
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + j).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + j).to(tl.float32)
        k1, k2 = _rotate(tl.load(k_row + j, mask=hmask), tl.load(k_row + HALF + j, mask=hmask), cos, sin)
        if FMT == 0:
            tl.store(kc_ptr + dst + j, k1.to(kc_ptr.dtype.element_ty), mask=hmask)
            tl.store(kc_ptr + dst + HALF + j, k2.to(kc_ptr.dtype.element_ty), mask=hmask)
        else:  # rounded to the input's dtype first, as the unquantized cache stores it
            k1 = k1.to(k_ptr.dtype.element_ty).to(tl.float32)
            k2 = k2.to(k_ptr.dtype.element_ty).to(tl.float32)
            _store_q8(kc_ptr, kcf_ptr, dst, fdst, k1, k2, hmask, j, HALF, HD, QMAX, FMT)
        qh = tl.arange(0, NH_P)[:, None]
        qmask = qh < NH
        q_row = q_ptr + t * stride_qt + qh * stride_qh
        q1, q2 = _rotate(tl.load(q_row + j, mask=qmask), tl.load(q_row + HALF + j, mask=qmask), cos, sin)
        tl.store(q_row + j, q1.to(q_ptr.dtype.element_ty), mask=qmask)
        tl.store(q_row + HALF + j, q2.to(q_ptr.dtype.element_ty), mask=qmask)
    elif FMT == 0:
        d = tl.arange(0, HD)[None, :]
        tl.store(kc_ptr + dst + d, tl.load(k_row + d, mask=hmask), mask=hmask)
    else:
        d = tl.arange(0, HD)[None, :]
        k = tl.load(k_row + d, mask=hmask, other=0.0).to(tl.float32)
        _store_q8(kc_ptr, kcf_ptr, dst, fdst, k, k, hmask, d, HD, HD, QMAX, FMT)
    d = tl.arange(0, HD)[None, :]
    if FMT == 0:
        tl.store(vc_ptr + dst + d, tl.load(v_row + d, mask=hmask), mask=hmask)
    else:
        v = tl.load(v_row + d, mask=hmask, other=0.0).to(tl.float32)
        _store_q8(vc_ptr, vcf_ptr, dst, fdst, v, v, hmask, d, HD, HD, QMAX, FMT)


def _check(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    _, _, _, nkv, _ = kv_cache.shape
    hd = head_dim_of(kv_cache)
    if k.shape[1:] != (nkv, hd) or v.shape != k.shape or slot_mapping.shape != k.shape[:1]:
        raise ValueError("k, v must be [T, kv_heads, head_dim] and slot_mapping [T]")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("head_dim must be contiguous")
    if hd & (hd - 1):
        raise ValueError(f"head_dim must be a power of two, got {hd}")


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot] = k, v for every token whose slot is >= 0. k, v: [T, kv_heads, head_dim],
    any token/head strides (views of a fused qkv output are fine)."""
    _check(k, v, kv_cache, slot_mapping)
    _launch(k, v, kv_cache, slot_mapping, None, None, None, None)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> None:
    """RoPE on q (in place, [T, heads, head_dim]) and on k as it is written; v written as is.
    cos, sin: [max_positions, head_dim // 2] (any row stride), e.g. `rope_table(...)[:, 0, 0]`
    and `[:, 1, 1]`; positions: [T] ints."""
    _check(k, v, kv_cache, slot_mapping)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.stride(-1) != 1:
        raise ValueError("q must be [T, heads, head_dim] with head_dim contiguous")
    if cos.shape[1] != k.shape[2] // 2 or sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos, sin must be [max_positions, head_dim // 2], last dim contiguous")
    _launch(k, v, kv_cache, slot_mapping, q, cos, sin, positions)


def _launch(k, v, kv_cache, slots, q, cos, sin, positions) -> None:
    T = k.shape[0]
    if T == 0:
        return
    _, _, bs, nkv, _ = kv_cache.shape
    hd = head_dim_of(kv_cache)
    fmt = format_of(kv_cache)
    rope = q is not None
    cache, fcache, code = quant_views(kv_cache)
    kc, vc, kf, vf = cache[0], cache[1], fcache[0], fcache[1]
    nh = q.shape[1] if rope else 1
    _write_kv_kernel[(T,)](
        k, v, kc, vc, slots,
        q if rope else k, cos if rope else k, sin if rope else k, positions if rope else slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        q.stride(0) if rope else 0, q.stride(1) if rope else 0,
        cos.stride(0) if rope else 0, sin.stride(0) if rope else 0,
        kf, vf, kf.stride(0), kf.stride(1), kf.stride(2),
        NKV=nkv, NKV_P=triton.next_power_of_2(nkv), NH=nh, NH_P=triton.next_power_of_2(nh),
        HD=hd, BS=bs, ROPE=rope, QMAX=fmt.qmax if fmt else 0.0, FMT=code, num_warps=4,
    )
