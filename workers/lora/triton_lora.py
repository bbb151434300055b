"""The batched LoRA GEMMs on CUDA: one shrink and one expand launch cover every adapter.

`y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T` for groups of rows that share a slot
(Punica's SGMV): the host sorts the step's rows by adapter and cuts each group into
tiles of BLOCK_M rows (batch.TileTable); a program takes one tile.

- Shrink (x [T, K] -> t [T, R], K the hidden size, R the rank): a decode batch has a
  few tiles and R is narrow, so one program per tile would walk all of K alone and a
  launch would use a handful of SMs. The K range is split over SPLIT programs per tile,
  each writing a float32 partial [SPLIT, T, R].
- Expand (t -> y [T, N], added): the partials are summed as they are loaded (R is
  small, so this costs nothing and needs no atomics or extra launch); programs tile N.

The tile table is padded to a fixed length (empty tiles return at once) and SPLIT
depends on K only, so a launch depends on shapes only (CUDA-graph capturable).
Tests run it under TRITON_INTERPRET=1 on the CPU.

`LoRATile` holds the launch shape (inputs per shrink program, output columns per expand
program, warps); `TILE` is the one every call uses unless given another.
`python3 -m kvyard.bench.gpu_lora_tune` times a grid of them on a GPU at the 8B shapes
and suggests a replacement (Triton's autotuner cannot choose here: a warm-up step's tile
table is empty, so every configuration would time the same).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@dataclass(slots=True, frozen=True)
class LoRATile:
    k_per_program: int = 512     # shrink: about this many inputs a program (at most 16 splits)
    max_block_n: int = 64        # expand: output columns a program (power of two, at most)
    shrink_warps: int = 4
    expand_warps: int = 4


# The tune's choice on an H100 (docs/bench/gpu-wave3-loratune-h100.json: geomean 1.12x the
# class defaults over the 8B projections; gate_up at 64 rows over 16 adapters 1.9x).
TILE = LoRATile(k_per_program=512, max_block_n=256, shrink_warps=2, expand_warps=4)


@triton.jit
def _tile(rows_ptr, tile_slot_ptr, tile_start_ptr, tile, n_rows, BLOCK_M: tl.constexpr):
    """A tile's slot, its (up to BLOCK_M) row indices and their mask."""
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < n_rows
    rows = tl.load(rows_ptr + tl.load(tile_start_ptr + tile) + offs_m, mask=mmask, other=0).to(tl.int64)
    return slot, rows, mmask


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, part_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                   R, K, PER_SPLIT, stride_xm, stride_as, stride_ar, stride_ps, stride_pm,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n_rows = tl.load(tile_len_ptr + tile)
    if n_rows == 0:
        return
    slot, rows, mmask = _tile(rows_ptr, tile_slot_ptr, tile_start_ptr, tile, n_rows, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot * stride_as
    k_lo = split * PER_SPLIT
    for k0 in range(k_lo, k_lo + PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=kmask[:, None] & rmask[None, :],
                    other=0.0)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(part_ptr + split * stride_ps + rows[:, None] * stride_pm + offs_r[None, :], acc,
             mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _expand_kernel(part_ptr, b_ptr, y_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                   N, R, stride_ps, stride_pm, stride_bs, stride_bn, stride_ym,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_rows = tl.load(tile_len_ptr + tile)
    if n_rows == 0:
        return
    slot, rows, mmask = _tile(rows_ptr, tile_slot_ptr, tile_start_ptr, tile, n_rows, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    t_ptrs = part_ptr + rows[:, None] * stride_pm + offs_r[None, :]
    tmask = mmask[:, None] & rmask[None, :]
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        t += tl.load(t_ptrs + s * stride_ps, mask=tmask, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=rmask[:, None] & nmask[None, :], other=0.0)
    if IEEE:
        acc = tl.dot(t, b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(t.to(b.dtype), b)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    ymask = mmask[:, None] & nmask[None, :]
    acc += tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


def _splits(k: int, k_per_program: int = 512) -> tuple[int, int, int]:
    """(SPLIT, per-split K, BLOCK_K): ~k_per_program inputs a program, at most 16 programs a tile."""
    block_k = max(16, min(128, triton.next_power_of_2(k)))
    split = max(1, min(16, k // k_per_program))
    per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return triton.cdiv(k, per), per, block_k


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
               tile_slot: torch.Tensor, tile_start: torch.Tensor, tile_len: torch.Tensor,
               tile: LoRATile | None = None) -> None:
    """y[rows of each tile] += (x[those rows] @ a[slot]^T) @ b[slot]^T. x [T, K], y [T, N] with
    unit column stride (y may be a column slice); a [slots, R, K] and b [slots, N, R] contiguous."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    tile = tile or TILE   # read at call time, so a bench can set the module's TILE
    r, k, n = a.shape[1], a.shape[2], b.shape[1]
    split, per, block_k = _splits(k, tile.k_per_program)
    block_r = max(16, triton.next_power_of_2(r))
    part = torch.empty(split, x.shape[0], r, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    tiles = tile_len.shape[0]
    _shrink_kernel[(tiles, split)](x, a, part, rows, tile_slot, tile_start, tile_len, r, k, per,
                                   x.stride(0), a.stride(0), a.stride(1), part.stride(0), part.stride(1),
                                   IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
                                   num_warps=tile.shrink_warps)
    block_n = max(16, min(tile.max_block_n, triton.next_power_of_2(n)))
    _expand_kernel[(tiles, triton.cdiv(n, block_n))](part, b, y, rows, tile_slot, tile_start, tile_len, n, r,
                                                     part.stride(0), part.stride(1), b.stride(0), b.stride(1),
                                                     y.stride(0), SPLIT=split, IEEE=ieee, BLOCK_M=BLOCK_M,
                                                     BLOCK_N=block_n, BLOCK_R=block_r,
                                                     num_warps=tile.expand_warps)
