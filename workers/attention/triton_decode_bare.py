"""Paged decode attention over a bare E4M3 cache (`--kv-cache-dtype fp8_e4m3`, kv_quant.py).

Rows are head_dim codes and nothing else, so every row is 16-byte aligned and a tile of keys
loads as the bf16 kernel's does (16-byte async copies, the row offset hinted a multiple of
16). Codes widen to fp16 in registers, four at a time through `cvt.rn.f16x2.e4m3x2` (an
opaque PTX block, so the compiler widens before the dot's layout change instead of reading
the 8-bit tile byte by byte from shared memory afterwards), and the dots run in fp16 (E4M3
codes are exact there, and so are q's values). A float32 q (the demo model) widens to
float32 and keeps IEEE dots. Under TRITON_INTERPRET, which runs no PTX, the same widening is
integer bit arithmetic (triton_kv_quant.decode_codes).

Structure, grid and split-K partials are triton_decode.py's; `TILES` holds the variant and
launch shape per split and unsplit launch.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .triton_decode_quant import program_range
from .triton_decode_quant_bytes import _finish, _online, _rows
from .triton_decode_quant_fast import _natural
from .triton_kv_quant import decode_codes

try:
    from . import gluon_decode_bare
except ImportError:   # a Triton without Gluon: the Triton kernel everywhere
    gluon_decode_bare = None  # type: ignore[assignment]

# (variant, block_n, num_warps, num_stages) for split and unsplit launches of a 16-bit q. Variants
# (VARIANTS; see _tile): "bytes", K and V as 8-bit tiles widened whole; "words", both read as
# int32 words; "mixed", K as bytes (its operand needs no transpose, so the 8-bit tile reaches the
# dot through ldmatrix and widens there) and V as words. These kernels' K/V loads are register
# gathers through the block table, which Triton does not pipeline through shared memory, so a
# program has about one tile in flight, and fp8's tiles hold half of bf16's bytes.
# "gluon" (GLUON) names the Gluon kernel (gluon_decode_bare.py), where `supported` says it can
# run: its copies go through a ring of `num_stages` cp.async buffers, so small one-warp programs
# keep several tiles each in flight. `kvyard.bench.gpu_kvquant --bare-tune` over both kernels
# picks RING (16 keys, one warp, a ring of 4, splits x 2): on an H100 0.92x bf16's throughput per
# byte, where the Triton kernel's best launches (TRITON_TILES, TRITON_SPLITS_X) reach 0.82x
# (docs/benchmarks.md). TILES and SPLITS_X hold the engine's launches: RING, or the Triton
# launches with a Triton that has no Gluon. A launch the Gluon kernel cannot run (float32 q,
# cards before sm_89, unaligned caches) takes TRITON_TILES' tile with the engine's SPLITS_X.
GLUON = "gluon"
TRITON_TILES = {"split": ("bytes", 128, 4, 2), "unsplit": ("words", 64, 4, 2)}
# Split launches take decode_config's splits times this (at most 64): a split's bytes are half
# of bf16's, so the per-split prologue and the merge weigh more.
TRITON_SPLITS_X = 4
RING = ((GLUON, 16, 1, 4), 2)
VARIANTS = {"bytes": 0, "words": 1, "mixed": 2}


def ring_launches() -> tuple[dict[str, tuple[str, int, int, int]], int]:
    """The TILES and SPLITS_X that launch RING for both kinds of launch."""
    tile, splits_x = RING
    return {"split": tile, "unsplit": tile}, splits_x


def triton_launches() -> tuple[dict[str, tuple[str, int, int, int]], int]:
    """The TILES and SPLITS_X that launch the Triton kernel's picks."""
    return dict(TRITON_TILES), TRITON_SPLITS_X


TILES, SPLITS_X = ring_launches() if gluon_decode_bare is not None else triton_launches()


def splits_for(num_splits: int, max_context: int) -> int:
    """The splits of a launch over this format where decode_config gives `num_splits`."""
    if num_splits == 1:
        return 1
    return max(1, min(64, num_splits * SPLITS_X, max_context // 128))


_E4M3X4 = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")


@triton.jit
def _widen(x, F16: tl.constexpr, ASM: tl.constexpr):
    """uint8 E4M3 codes -> float16 (F16) or float32 values."""
    if F16 and ASM:
        y = tl.inline_asm_elementwise(_E4M3X4, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    elif F16:
        y = decode_codes(x, 2).to(tl.float16)
    else:
        y = decode_codes(x, 2)
    return y


@triton.jit
def _tile(c_ptr, w_ptr, row, valid, d, F16: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr):
    """Rows [BLOCK_N, HD] at byte offsets `row`, widened. WORDS: read as int32 words and widened
    4 codes a word (the asm variant's slices, re-interleaved), so no 8-bit tile reaches the dot."""
    if WORDS:
        HD4: tl.constexpr = d.shape[0] // 4
        d4 = tl.arange(0, HD4)
        w = tl.load(w_ptr + (row // 4)[:, None] + d4[None, :], mask=valid[:, None], other=0)
        y = _natural(w, 2, ASM)
        if not F16:
            y = y.to(tl.float32)
    else:
        y = _widen(tl.load(c_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0), F16, ASM)
    return y


@triton.jit
def decode_bare_kernel(q_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
                       stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_cb, stride_ct, stride_ch,
                       stride_pb, stride_ph, stride_lb, stride_lh, scale_log2,
                       G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                       BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr,
                       F16: tl.constexpr, ASM: tl.constexpr, ALIGNED: tl.constexpr, WORDS: tl.constexpr):
    """k/v: the caches as bytes, kw/vw as int32 words. ALIGNED: every row starts on a 16-byte
    boundary. WORDS: VARIANTS' value (0 neither, 1 K and V, 2 V only read as words)."""
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask, other=0.0)
    if F16:
        q = q.to(tl.float16)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        valid, row = _rows(bt_row, n0, end, kh, BS, BLOCK_N, stride_cb, stride_ct, stride_ch)
        if ALIGNED:
            row = tl.multiple_of(row, 16)
        k = _tile(k_ptr, kw_ptr, row, valid, d, F16, ASM, WORDS == 1)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        p, alpha, m_i, l_i = _online(qk, valid, m_i, l_i)
        v = _tile(v_ptr, vw_ptr, row, valid, d, F16, ASM, WORDS >= 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    _finish(acc, m_i, l_i, b, s, g, heads, gmask, o_ptr, part_ptr, lse_ptr, stride_ob, stride_oh,
            stride_pb, stride_ph, stride_lb, stride_lh, G, HD, NUM_SPLITS, 1.0)


def decode_bare(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor, scale_log2: float, config: Any, *,
                group: int, group_pad: int, prec: str) -> None:
    """Launch over a bare E4M3 cache (triton_decode.paged_decode checks shapes and merges splits);
    the config's quant_* fields override `TILES` (quant_variant where it names one of VARIANTS or
    GLUON: the other names are the scaled formats' kernels)."""
    S = config.num_splits
    kind = "split" if S > 1 else "unsplit"
    variant, bn, warps, stages = TILES[kind] if q.dtype != torch.float32 else ("bytes", 32, 4, 2)
    if config.quant_variant in VARIANTS or config.quant_variant == GLUON:
        variant = config.quant_variant
    cb = kv_cache.view(torch.uint8)
    kc, vc = cb[0], cb[1]
    if variant == GLUON and not (gluon_decode_bare is not None and gluon_decode_bare.supported(
            q, cb, group_pad, config.quant_block_n or bn, config.quant_num_warps or warps)):
        variant, bn, warps, stages = TRITON_TILES[kind] if q.dtype != torch.float32 else ("bytes", 32, 4, 2)
    bn, warps, stages = (config.quant_block_n or bn, config.quant_num_warps or warps,
                         config.quant_num_stages or stages)
    if variant == GLUON:
        gluon_decode_bare.decode_bare_gluon(q, kc, vc, block_tables, seq_lens, out, part, lse, scale_log2,
                                            group=group, group_pad=group_pad, splits=S, block_n=bn, warps=warps,
                                            stages=stages)
        return
    B, _, hd = q.shape
    aligned = cb.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in cb.stride()[:4])
    asm = (not isinstance(decode_bare_kernel, InterpretedFunction) and q.is_cuda
           and torch.cuda.get_device_capability(q.device) >= (8, 9))
    cw = kv_cache.view(torch.int32)
    decode_bare_kernel[(B, kc.shape[2], S)](
        q, kc, vc, cw[0], cw[1], block_tables, seq_lens, out, part, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
        scale_log2, G=group, GP=group_pad, HD=hd, BS=kc.shape[1], BLOCK_N=bn, NUM_SPLITS=S, PREC=prec,
        F16=q.dtype != torch.float32, ASM=asm, ALIGNED=aligned, WORDS=VARIANTS[variant],
        num_warps=warps, num_stages=stages)
