"""Paged decode attention over a quantized KV cache: kernel variants and the choice between them.

On Hopper the word kernel (triton_decode_quant.py, variant "words") is ALU-bound, not
memory-bound: each code byte costs a shift, a mask, a narrowing cast, a bitcast and an
fp8 -> bf16 convert, and since rows are only 4-byte aligned every load is 4 bytes wide with
its own address arithmetic, predicate and cp.async. Its sm_90 loop issues ~0.35 warp
instructions per byte read, the bf16 kernel's ~0.06, where an H200 issues ~0.22 per byte at
full HBM rate (static counts from the SASS; the tuning run measures). The variants here cut
that cost and keep the row layout (head_dim code bytes then a float32 scale, kv_quant.py):

- "asm": rows as int32 words, as "words", but one PTX block widens two words into the 4
  codes of each as float16 pairs: fp8 by `cvt.rn.f16x2.e4m3x2`, int8 by the magic-number
  trick (byte ^ 0x80 placed under fp16 exponent 0x6400 is 1024 + code + 128; one
  `sub.f16x2` removes 1152), ~1-1.5 instructions per byte, each output already a packed
  pair. Under TRITON_INTERPRET (which runs no assembly) the same kernel widens with plain
  Triton ops (ASM=False).
- "bytes" / "bytes_t" (triton_decode_quant_bytes.py): the codes as one uint8 tile, one
  native widening and one dot per K and V tile; "bytes_t" with the keys as the MMA's M.
- "win": "asm" over 16-byte-aligned windows, so the loads are 16 bytes wide. When block and
  token strides are multiples of 16 bytes (KV heads a multiple of 4, as in Llama-3's 8),
  every row of one KV head starts the same ph words past a 16-byte boundary; the kernel
  reads each row's aligned window (head_dim + 16 bytes) as head_dim / 4 words through the
  4 slices of "asm", with q's slices shifted by ph words, and the 4 words after in memory
  order against q's tail: no byte moves, only q and the output shift. Other layouts fall
  back to "bytes". At sm_90 its loop is ~0.15-0.2 warp instructions per byte.

In the new variants the dots run in float16 when q is 16-bit: int8 and E4M3 codes are
exact in fp16, so are q's values (|q| < 65504), and the fp8 -> fp16 conversion is the
device's cheapest. The V scale folds into p (p * scale, in [0, amax]) times a power of
two (VMUL: 512 for fp8, 128 for int8) so that small V rows stay clear of fp16's subnormals;
the output divides it out again (exact). A float32 q keeps float32 dots.

`DEFAULTS` is the one table to edit after a tuning run (`python3 -m
kvyard.bench.gpu_kvquant_tune`, docs/gpu-notes.md): per format, the variant and tile for
split and unsplit launches of a 16-bit q; its JSON's `suggested_defaults` has this table's
shape. A DecodeConfig's `quant_*` fields override it per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .kv_quant import format_of
from .triton_decode_quant import _store_slices, _widen, decode_quant_kernel, program_range
from .triton_decode_quant_bytes import _dot_dtype, _online, _rows, _store_lse, decode_bytes_kernel


@dataclass(slots=True, frozen=True)
class QuantTile:
    """Which quantized kernel and tile; a None field takes the DecodeConfig's own value."""

    variant: str = "words"
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


# The kernel per format for split (several programs per sequence) and unsplit launches:
# the tuning run's suggested_defaults on an H100 (docs/bench/gpu-wave3-kvtune-h100.json),
# where "asm" led at every shape (fp8 0.57x bf16's throughput per byte, "words" 0.50x).
DEFAULTS: dict[str, dict[str, QuantTile]] = {
    "fp8": {"split": QuantTile("asm", 128, 4, 2), "unsplit": QuantTile("asm", 32, 4, 3)},
    "int8": {"split": QuantTile("asm", 128, 4, 2), "unsplit": QuantTile("asm", 128, 4, 2)},
}
# A float32 q (the demo model on CUDA) keeps "words": the tuning run measures bf16 only.
FLOAT32_DEFAULTS = {f: {"split": QuantTile("words"), "unsplit": QuantTile("words")} for f in DEFAULTS}
VARIANTS = ("words", "asm", "bytes", "bytes_t", "win")
VMUL = {1: 128.0, 2: 512.0}   # by format code: V scale multiplier (a power of two; see above)


class TileConfig(Protocol):
    """What the launch reads from triton_decode.DecodeConfig."""

    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    quant_variant: str | None
    quant_block_n: int | None
    quant_num_warps: int | None
    quant_num_stages: int | None


def choose_tile(fmt: str, config: TileConfig, table: dict[str, dict[str, QuantTile]] | None = None) -> QuantTile:
    """The variant and tile for one launch, every field set: the config's quant_* fields, else
    the table's entry (when it names the same variant), else the config's block_n/warps/stages."""
    entry = (table or DEFAULTS)[fmt]["split" if config.num_splits > 1 else "unsplit"]
    variant = config.quant_variant or entry.variant
    if variant not in VARIANTS:
        raise ValueError(f"unknown quantized decode variant {variant!r}: {', '.join(VARIANTS)}")
    if variant != entry.variant:
        entry = QuantTile(variant)
    return QuantTile(variant,
                     config.quant_block_n or entry.block_n or config.block_n,
                     config.quant_num_warps or entry.num_warps or config.num_warps,
                     config.quant_num_stages or entry.num_stages or config.num_stages)


# One asm instance widens 2 int32 words ($4, $5; pack=2) into 4 outputs, output i holding byte i
# of both words as one f16x2 register (low half: $4's), the layout the dots read, so no repacking.
_E4M3X4 = tl.constexpr("""{
.reg .b32 lo, hi;
.reg .b16 l0, l1, h0, h1;
prmt.b32 lo, $4, $5, 0x5140;   // [w0.b0, w1.b0, w0.b1, w1.b1]
prmt.b32 hi, $4, $5, 0x7362;   // [w0.b2, w1.b2, w0.b3, w1.b3]
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
}""")
_S8X4 = tl.constexpr("""{
.reg .b32 lo, hi, m;
prmt.b32 lo, $4, $5, 0x5140;
prmt.b32 hi, $4, $5, 0x7362;
xor.b32 lo, lo, 0x80808080;          // each signed byte -> code + 128, unsigned
xor.b32 hi, hi, 0x80808080;
prmt.b32 $0, lo, 0x64646464, 0x4140; // [byte, 0x64, byte, 0x64]: fp16 1024 + byte, twice
prmt.b32 $1, lo, 0x64646464, 0x4342;
prmt.b32 $2, hi, 0x64646464, 0x4140;
prmt.b32 $3, hi, 0x64646464, 0x4342;
mov.b32 m, 0x64806480;               // fp16 1152 = 1024 + 128, twice
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
sub.f16x2 $2, $2, m;
sub.f16x2 $3, $3, m;
}""")


@triton.jit
def _widen4_asm(w, FMT: tl.constexpr):
    if FMT == 1:
        return tl.inline_asm_elementwise(_S8X4, "=r,=r,=r,=r,r,r", [w], is_pure=True, pack=2,
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16))
    return tl.inline_asm_elementwise(_E4M3X4, "=r,=r,=r,=r,r,r", [w], is_pure=True, pack=2,
                                     dtype=(tl.float16, tl.float16, tl.float16, tl.float16))


@triton.jit
def _widen4(w, FMT: tl.constexpr, ASM: tl.constexpr):
    """The 4 codes of each int32 word (byte i -> output i) as float16 values."""
    if ASM:
        return _widen4_asm(w, FMT)
    return (_widen(w, 0, FMT, tl.float16), _widen(w, 1, FMT, tl.float16), _widen(w, 2, FMT, tl.float16),
            _widen(w, 3, FMT, tl.float16))


@triton.jit
def decode_asm_kernel(
    q_ptr, k_ptr, v_ptr, kf_ptr, vf_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_wb, stride_wt, stride_wh,
    stride_pb, stride_ph, stride_lb, stride_lh, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, FMT: tl.constexpr,
    F16: tl.constexpr, VM: tl.constexpr, ASM: tl.constexpr,
):
    """k/v: the caches as int32 words (kf/vf unused: the scale is each row's last word)."""
    W: tl.constexpr = HD // 4
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    d4 = tl.arange(0, W)
    qrow = q_ptr + b * stride_qb + heads[:, None] * stride_qh + 4 * d4[None, :]
    q0 = _dot_dtype(tl.load(qrow, mask=gmask, other=0.0), F16)
    q1 = _dot_dtype(tl.load(qrow + 1, mask=gmask, other=0.0), F16)
    q2 = _dot_dtype(tl.load(qrow + 2, mask=gmask, other=0.0), F16)
    q3 = _dot_dtype(tl.load(qrow + 3, mask=gmask, other=0.0), F16)
    dt = q0.dtype
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, W], tl.float32)
    a1 = tl.zeros([GP, W], tl.float32)
    a2 = tl.zeros([GP, W], tl.float32)
    a3 = tl.zeros([GP, W], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        valid, row = _rows(bt_row, n0, end, kh, BS, BLOCK_N, stride_wb, stride_wt, stride_wh)
        off = row[:, None] + d4[None, :]
        k0, k1, k2, k3 = _widen4(tl.load(k_ptr + off, mask=valid[:, None], other=0), FMT, ASM)
        ks = tl.load(k_ptr + row + W, mask=valid, other=0).to(tl.float32, bitcast=True)
        qk = tl.dot(q0, tl.trans(k0.to(dt)), input_precision=PREC)
        qk += tl.dot(q1, tl.trans(k1.to(dt)), input_precision=PREC)
        qk += tl.dot(q2, tl.trans(k2.to(dt)), input_precision=PREC)
        qk += tl.dot(q3, tl.trans(k3.to(dt)), input_precision=PREC)
        p, alpha, m_i, l_i = _online(qk * (ks * scale_log2)[None, :], valid, m_i, l_i)
        v0, v1, v2, v3 = _widen4(tl.load(v_ptr + off, mask=valid[:, None], other=0), FMT, ASM)
        vs = tl.load(v_ptr + row + W, mask=valid, other=0).to(tl.float32, bitcast=True)
        pv = (p * (vs * VM)[None, :]).to(dt)
        a0 = a0 * alpha[:, None] + tl.dot(pv, v0.to(dt), input_precision=PREC)
        a1 = a1 * alpha[:, None] + tl.dot(pv, v1.to(dt), input_precision=PREC)
        a2 = a2 * alpha[:, None] + tl.dot(pv, v2.to(dt), input_precision=PREC)
        a3 = a3 * alpha[:, None] + tl.dot(pv, v3.to(dt), input_precision=PREC)
    den = (tl.where(l_i > 0, l_i, 1.0) * VM)[:, None]
    if NUM_SPLITS == 1:
        t = o_ptr.dtype.element_ty
        _store_slices(o_ptr + b * stride_ob + heads[:, None] * stride_oh, (a0 / den).to(t), (a1 / den).to(t),
                      (a2 / den).to(t), (a3 / den).to(t), d4, gmask)
    else:
        _store_slices(part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * HD, a0 / den, a1 / den,
                      a2 / den, a3 / den, d4, gmask)
        _store_lse(lse_ptr, b, s, g, heads, m_i, l_i, stride_lb, stride_lh, G)


@triton.jit
def _natural(w, FMT: tl.constexpr, ASM: tl.constexpr):
    """int32 words [R, C] -> their 4C codes as float16 [R, 4C] in memory order."""
    c0, c1, c2, c3 = _widen4(w, FMT, ASM)
    x = tl.join(tl.join(c0, c2), tl.join(c1, c3))   # [R, C, 2, 2]: [.., k, m] is byte 2k + m
    return tl.reshape(x, [w.shape[0], 4 * w.shape[1]])


@triton.jit
def _window(w_ptr, wrow, valid, ph, W: tl.constexpr, MASK: tl.constexpr):
    """A row's 16-byte-aligned window as int32 words: the first W [rows, W] and the 4 after (as
    8 columns, the last 4 zero: a [group, 16] accumulator would make Triton split every chained
    dot's warps over the 16 query rows). The row starts `ph` words in. MASK zeroes the words
    that are not the row's codes (an fp8 view of a scale may be NaN, and 0 * NaN is NaN)."""
    c = tl.arange(0, W)
    e = tl.arange(0, 8)
    a = tl.load(w_ptr + wrow[:, None] + c[None, :], mask=valid[:, None], other=0)
    b = tl.load(w_ptr + wrow[:, None] + W + e[None, :], mask=valid[:, None] & (e < 4)[None, :], other=0)
    if MASK:
        a = tl.where((c >= ph)[None, :], a, 0)
        b = tl.where((e < ph)[None, :], b, 0)
    return a, b


@triton.jit
def decode_win_kernel(
    q_ptr, k_ptr, v_ptr, kf_ptr, vf_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_wb, stride_wt, stride_wh,
    stride_pb, stride_ph, stride_lb, stride_lh, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, FMT: tl.constexpr,
    F16: tl.constexpr, VM: tl.constexpr, ASM: tl.constexpr,
):
    """k/v: the caches as int32 words (kf/vf unused). Needs block and token strides of a multiple
    of 16 bytes: then every row of this KV head starts ph words past a 16-byte boundary. The
    window's first HD bytes go through "asm"'s 4 slices with q's slices shifted by ph words; its
    16-byte tail (the row's last ph words, then its scale) in memory order against q's tail."""
    W: tl.constexpr = HD // 4
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    ph = (kh * stride_wh) % 4
    c = tl.arange(0, W)
    e = tl.arange(0, 32)
    qrow = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    qs = qrow + 4 * (c - ph)[None, :]
    qm = gmask & (c >= ph)[None, :]
    q0 = _dot_dtype(tl.load(qs, mask=qm, other=0.0), F16)
    q1 = _dot_dtype(tl.load(qs + 1, mask=qm, other=0.0), F16)
    q2 = _dot_dtype(tl.load(qs + 2, mask=qm, other=0.0), F16)
    q3 = _dot_dtype(tl.load(qs + 3, mask=qm, other=0.0), F16)
    qt = _dot_dtype(tl.load(qrow + (HD + e - 4 * ph)[None, :], mask=gmask & (e < 4 * ph)[None, :], other=0.0), F16)
    dt = q0.dtype
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, W], tl.float32)
    a1 = tl.zeros([GP, W], tl.float32)
    a2 = tl.zeros([GP, W], tl.float32)
    a3 = tl.zeros([GP, W], tl.float32)
    at = tl.zeros([GP, 32], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        valid, row = _rows(bt_row, n0, end, kh, BS, BLOCK_N, stride_wb, stride_wt, stride_wh)
        wrow = tl.multiple_of(row - ph, 4)
        kw, ktw = _window(k_ptr, wrow, valid, ph, W, FMT == 2)
        k0, k1, k2, k3 = _widen4(kw, FMT, ASM)
        ks = tl.load(k_ptr + row + W, mask=valid, other=0).to(tl.float32, bitcast=True)
        qk = tl.dot(q0, tl.trans(k0.to(dt)), input_precision=PREC)
        qk += tl.dot(q1, tl.trans(k1.to(dt)), input_precision=PREC)
        qk += tl.dot(q2, tl.trans(k2.to(dt)), input_precision=PREC)
        qk += tl.dot(q3, tl.trans(k3.to(dt)), input_precision=PREC)
        qk += tl.dot(qt, tl.trans(_natural(ktw, FMT, ASM).to(dt)), input_precision=PREC)
        p, alpha, m_i, l_i = _online(qk * (ks * scale_log2)[None, :], valid, m_i, l_i)
        # V needs no mask: the window's other words land in output columns that are never stored
        vw, vtw = _window(v_ptr, wrow, valid, ph, W, False)
        v0, v1, v2, v3 = _widen4(vw, FMT, ASM)
        vs = tl.load(v_ptr + row + W, mask=valid, other=0).to(tl.float32, bitcast=True)
        pv = (p * (vs * VM)[None, :]).to(dt)
        a0 = a0 * alpha[:, None] + tl.dot(pv, v0.to(dt), input_precision=PREC)
        a1 = a1 * alpha[:, None] + tl.dot(pv, v1.to(dt), input_precision=PREC)
        a2 = a2 * alpha[:, None] + tl.dot(pv, v2.to(dt), input_precision=PREC)
        a3 = a3 * alpha[:, None] + tl.dot(pv, v3.to(dt), input_precision=PREC)
        at = at * alpha[:, None] + tl.dot(pv, _natural(vtw, FMT, ASM).to(dt), input_precision=PREC)
    den = (tl.where(l_i > 0, l_i, 1.0) * VM)[:, None]
    tm = gmask & (e < 4 * ph)[None, :]
    if NUM_SPLITS == 1:
        t = o_ptr.dtype.element_ty
        orow = o_ptr + b * stride_ob + heads[:, None] * stride_oh
        _store_slices(orow - 4 * ph, (a0 / den).to(t), (a1 / den).to(t), (a2 / den).to(t), (a3 / den).to(t), c, qm)
        tl.store(orow + (HD + e - 4 * ph)[None, :], (at / den).to(t), mask=tm)
    else:
        prow = part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * HD
        _store_slices(prow - 4 * ph, a0 / den, a1 / den, a2 / den, a3 / den, c, qm)
        tl.store(prow + (HD + e - 4 * ph)[None, :], at / den, mask=tm)
        _store_lse(lse_ptr, b, s, g, heads, m_i, l_i, stride_lb, stride_lh, G)


_KERNELS = {"asm": decode_asm_kernel, "bytes": decode_bytes_kernel, "bytes_t": decode_bytes_kernel,
            "win": decode_win_kernel}


def _asm_ok(kernel: Any, device: torch.device, code: int) -> bool:
    """Inline PTX runs on CUDA only (not the interpreter); the e4m3x2 convert needs sm_89."""
    if isinstance(kernel, InterpretedFunction) or device.type != "cuda":
        return False
    return code == 1 or torch.cuda.get_device_capability(device) >= (8, 9)


def _windows_aligned(kv_cache: torch.Tensor) -> bool:
    """"win" reads 16-byte windows: every row of a KV head must sit at the same offset from a
    16-byte boundary, i.e. block and token strides (and V's start) a multiple of 16 bytes (at
    head_dim + 4 bytes a row: KV heads a multiple of 4)."""
    b = kv_cache.view(torch.uint8)
    return b.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in b.stride()[:3])


def decode_quantized(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor, scale_log2: float,
                     config: TileConfig, *, group: int, group_pad: int, prec: str) -> QuantTile:
    """Launch the chosen variant over a quantized cache with head_dim >= 64 (triton_decode.paged_decode
    checks the shapes, allocates the split workspace and merges); returns the tile it ran."""
    fmt = format_of(kv_cache)
    tile = choose_tile(fmt.name, config, FLOAT32_DEFAULTS if q.dtype == torch.float32 else DEFAULTS)
    S = config.num_splits
    B, _, hd = q.shape
    nkv = kv_cache.shape[3]
    words = kv_cache.view(torch.int32)
    kw, vw = words[0], words[1]
    common = (block_tables, seq_lens, out, part, lse,
              q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
              kw.stride(0), kw.stride(1), kw.stride(2),
              part.stride(0), part.stride(1), lse.stride(0), lse.stride(1), scale_log2)
    meta = dict(G=group, GP=group_pad, HD=hd, BS=kv_cache.shape[2], BLOCK_N=tile.block_n, NUM_SPLITS=S, PREC=prec,
                FMT=fmt.code, num_warps=tile.num_warps, num_stages=tile.num_stages)
    if tile.variant == "words":
        decode_quant_kernel[(B, nkv, S)](q, kw, vw, *common, **meta)
        return tile
    if tile.variant == "win" and not _windows_aligned(kv_cache):
        tile = QuantTile("bytes", tile.block_n, tile.num_warps, tile.num_stages)
    kernel = _KERNELS[tile.variant]
    if tile.variant in ("asm", "win"):
        k, v, kf, vf = kw, vw, kw, vw
    else:
        cb, cf = kv_cache.view(torch.uint8), kv_cache.view(torch.float32)
        k, v, kf, vf = cb[0], cb[1], cf[0], cf[1]
    if tile.variant == "bytes_t":
        meta["TRANS"] = True
    kernel[(B, nkv, S)](q, k, v, kf, vf, *common, F16=q.dtype != torch.float32, VM=VMUL[fmt.code],
                        ASM=tile.variant in ("asm", "win") and _asm_ok(kernel, q.device, fmt.code), **meta)
    return tile
