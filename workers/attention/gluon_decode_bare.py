"""Paged decode attention over a bare E4M3 cache, written in Gluon (Triton's explicit-layout
dialect) for sm_89+: the `gluon` variant of triton_decode_bare.

Why not plain Triton: its dot of a 16-bit q with keys widened from 8-bit codes picks a
k_width-4 operand layout and re-reads the loop-invariant q from shared memory on every tile,
rebuilding each MMA's register quad with moves; the scores then reach the P·V product through
shared memory again, and the softmax's max and sum cross warps. That is about 1,070
instructions per 128 keys against the bf16 kernel's 420 per 64 (tools/sass_decode.py), so the
8-bit kernel ran out of issue slots before it ran out of bytes. Here the layouts are chosen:
- a batched (rank-3) mma_v2 whose batch is the warp: each warp owns KC consecutive keys of the
  tile, so its scores, softmax and P·V stay in its own registers (P's accumulator layout is
  already the k_width-2 A operand), and the warps' partial results are merged once at the end;
- q is loaded once, straight into the k_width-4 A operand layout, and kept in registers;
- K codes go global -> shared by cp.async (16 bytes a copy) and shared -> registers by ldmatrix
  in the k_width-4 B layout, widened there by `cvt.rn.f16x2.e4m3x2`;
- V needs its keys along the MMA's k, across rows in memory (sm_90 has no 8-bit transposing
  ldmatrix), so its codes are widened to fp16 in a row layout and staged through shared memory
  once for a transposing ldmatrix;
- tiles go through a ring of STAGES shared buffers: the next STAGES - 1 tiles' copies are in
  flight during this tile's math (2: double-buffered; more keep more bytes in flight a program
  without the registers a register prefetch costs).

Numerics equal the Triton kernel's: fp16 dots of exact E4M3 values and fp16 q, float32
accumulation and online softmax in log2 units, the same split partials and lse. Masked copies
zero-fill, so a padding slot's NaN codes never reach a dot.

Gluon kernels do not run under TRITON_INTERPRET; triton_decode_bare keeps the Triton kernel for
the interpreter, float32 q, pre-sm_89 cards and unaligned caches.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .triton_decode_quant import split_range

# `supported` runs at every layer of every eager decode step (the ring is the default launch):
# a device's capability is asked once.
_capability = functools.lru_cache(maxsize=None)(torch.cuda.get_device_capability)


@gluon.jit
def _widen(x):
    """uint8 E4M3 codes -> float16, in x's layout (cvt.rn.f16x2.e4m3x2 on sm_89+)."""
    return x.to(gl.float8e4nv, bitcast=True).to(gl.float16)


@gluon.jit
def _issue(k_buf, v_buf, k_ptr, v_ptr, bt_row, n0, end, kh, stride_cb, stride_ct, stride_ch,
           cp: gl.constexpr, W: gl.constexpr, KC: gl.constexpr, HD: gl.constexpr, BS: gl.constexpr):
    """Start the copies of the tile at key n0 into (k_buf, v_buf): warp w's KC rows from n0 + w*KC.
    Rows past `end` are zero-filled (and their block-table reads masked)."""
    cb = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, cp)))
    cr = gl.arange(0, KC, layout=gl.SliceLayout(0, gl.SliceLayout(2, cp)))
    cc = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(1, cp)))
    pos = n0 + cb[:, None] * KC + cr[None, :]
    valid = pos < end
    blk = gl.load(bt_row + pos // BS, mask=valid, other=0).to(gl.int64)
    row = blk * stride_cb + (pos % BS) * stride_ct + kh * stride_ch
    off = gl.multiple_of(row, [16, 16])[:, :, None] + cc[None, None, :]
    async_copy.async_copy_global_to_shared(k_buf, k_ptr + off, mask=valid[:, :, None])
    async_copy.async_copy_global_to_shared(v_buf, v_ptr + off, mask=valid[:, :, None])
    async_copy.commit_group()


@gluon.jit
def decode_bare_gluon_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
                             stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_cb, stride_ct,
                             stride_ch, stride_pb, stride_ph, stride_lb, stride_lh, scale_log2, group,
                             G: gl.constexpr, GP: gl.constexpr, HD: gl.constexpr, BS: gl.constexpr,
                             BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr):
    """Grid (batch, KV head, split); k/v: the caches as bytes; `group` equals G. GP must be 16 (one
    MMA's rows); STAGES >= 2."""
    W: gl.constexpr = gl.num_warps()
    KC: gl.constexpr = BLOCK_N // W
    TPR: gl.constexpr = HD // 16                     # threads a 16-byte-per-thread row takes
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    qa: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    kb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    pa: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    vb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    cp: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[1, 32 // TPR, TPR],
                                        warps_per_cta=[W, 1, 1], order=[2, 1, 0])
    vr: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 32 // (TPR * 2), TPR * 2],
                                        warps_per_cta=[W, 1, 1], order=[2, 1, 0])
    PH: gl.constexpr = 128 // HD
    codes_l: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=PH, max_phase=8 // PH, order=[2, 1, 0])
    half_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=PH, max_phase=8 // PH, order=[2, 1, 0])

    b, kh, s, start, end = split_range(lens_ptr, BLOCK_N, NUM_SPLITS)
    bt_row = bt_ptr + b * stride_bt

    # q: every warp holds the group's rows in registers, widened to fp16 once.
    ob = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, qa)))
    om = gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, qa)))
    od = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(1, qa)))
    q_off = (kh * G + om)[None, :, None] * stride_qh + od[None, None, :] + ob[:, None, None] * 0
    # The padding rows' mask from the run-time group: a compile-time one lets ptxas fold those rows
    # to zero and rebuild every MMA operand quad around the zeros with moves, every tile.
    q = gl.load(q_ptr + b * stride_qb + q_off, mask=(om < group)[None, :, None], other=0.0).to(gl.float16)

    k_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, W, KC, HD], codes_l)
    v_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, W, KC, HD], codes_l)
    h_smem = gl.allocate_shared_memory(gl.float16, [W, KC, HD], half_l)

    mb = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(1, mma)))
    mc = gl.arange(0, KC, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    key = mb[:, None] * KC + mc[None, :]            # [W, KC]: the key's place in the tile
    m_i = gl.full([W, GP], float("-inf"), gl.float32, layout=gl.SliceLayout(2, mma))
    l_i = gl.zeros([W, GP], gl.float32, layout=gl.SliceLayout(2, mma))
    acc = gl.zeros([W, GP, HD], gl.float32, layout=mma)

    # Every iteration commits one copy group (empty past the end), so waiting until at most
    # STAGES - 1 groups are pending always means this tile's copies have landed.
    for st in gl.static_range(STAGES - 1):
        if start + st * BLOCK_N < end:
            _issue(k_smem.index(st), v_smem.index(st), k_ptr, v_ptr, bt_row, start + st * BLOCK_N, end, kh,
                   stride_cb, stride_ct, stride_ch, cp, W, KC, HD, BS)
        else:
            async_copy.commit_group()
    i = 0
    for n0 in range(start, end, BLOCK_N):
        buf = i % STAGES
        nxt = n0 + (STAGES - 1) * BLOCK_N
        if nxt < end:   # into the buffer the previous iteration freed
            _issue(k_smem.index((i + STAGES - 1) % STAGES), v_smem.index((i + STAGES - 1) % STAGES), k_ptr, v_ptr,
                   bt_row, nxt, end, kh, stride_cb, stride_ct, stride_ch, cp, W, KC, HD, BS)
        else:
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        kt = _widen(k_smem.index(buf).permute([0, 2, 1]).load(kb))            # [W, HD, KC]
        sc = mma_v2(q, kt, gl.zeros([W, GP, KC], gl.float32, layout=mma)) * scale_log2
        sc = gl.where(((n0 + key) < end)[:, None, :], sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=2))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)   # a warp with no valid key yet
        p = gl.exp2(sc - m_use[:, :, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=2)
        m_i = m_new
        h_smem.store(_widen(v_smem.index(buf).load(vr)))
        gl.thread_barrier()
        v = h_smem.load(vb)                                                      # [W, KC, HD]
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), pa), v, acc * alpha[:, :, None])
        gl.thread_barrier()      # h_smem and this tile's buffers are free for the next copies
        i += 1

    # Merge the warps' partials: each warp's max, sum and output against the row's max.
    m = gl.max(m_i, axis=0)
    f = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - gl.where(m == float("-inf"), 0.0, m)[None, :]))
    l_sum = gl.sum(l_i * f, axis=0)
    o = gl.sum(acc * f[:, :, None], axis=0)                                      # [GP, HD]
    og = gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(0, mma)))
    out = o / gl.convert_layout(gl.where(l_sum > 0, l_sum, 1.0), og.type.layout)[:, None]
    od2 = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(0, mma)))
    heads = kh * G + og
    rows = (og < G)[:, None]
    if NUM_SPLITS == 1:
        gl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + od2[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rows)
    else:
        gl.store(part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * HD + od2[None, :], out, mask=rows)
        lg = gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
        lse = gl.where(l_sum > 0, m + gl.log2(gl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
        gl.store(lse_ptr + b * stride_lb + (kh * G + lg) * stride_lh + s, lse, mask=lg < G)


def supported(q: torch.Tensor, kv_bytes: torch.Tensor, group_pad: int, block_n: int, warps: int) -> bool:
    """Whether the Gluon kernel can run this launch (else triton_decode_bare's Triton kernel)."""
    hd = q.shape[-1]
    kc = block_n // warps
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and group_pad == 16
            and _capability(q.device) >= (8, 9)
            and hd in (64, 128) and kc % 16 == 0 and block_n % warps == 0
            and kv_bytes.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in kv_bytes.stride()[:4]))


def decode_bare_gluon(q, kc, vc, block_tables, seq_lens, out, part, lse, scale_log2: float, *, group: int,
                      group_pad: int, splits: int, block_n: int, warps: int, stages: int = 2) -> None:
    """Launch over the K and V halves of a bare E4M3 cache as bytes (see `supported`)."""
    B, _, hd = q.shape
    decode_bare_gluon_kernel[(B, kc.shape[2], splits)](
        q, kc, vc, block_tables, seq_lens, out, part, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
        scale_log2, group, G=group, GP=group_pad, HD=hd, BS=kc.shape[1], BLOCK_N=block_n, NUM_SPLITS=splits,
        STAGES=max(2, stages), num_warps=warps)
