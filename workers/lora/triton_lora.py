"""The batched LoRA GEMM on CUDA: one launch covers every adapter in the batch.

`y[rows] (+)= x[rows] @ W[slot]^T` for groups of rows that share a slot (Punica's
SGMV): the host sorts the step's rows by adapter and cuts each group into tiles of
BLOCK_M rows; a program takes one tile and one BLOCK_N slice of the output, gathers
its rows of x, reads its adapter's weights from the stacked [slots, N, K] tensor and
accumulates with `tl.dot`. Shrink (x [T, K] -> t [T, R]) and expand (t -> y [T, N],
added) are two launches of the same kernel. The tile table is padded to a fixed
length (empty tiles return at once), so a launch depends on shapes only.
Tests run it under TRITON_INTERPRET=1 on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, y_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                 N, K, stride_xm, stride_ws, stride_wn, stride_ym,
                 ADD: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_rows = tl.load(tile_len_ptr + tile)
    if n_rows == 0:
        return
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < n_rows
    rows = tl.load(rows_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + slot * stride_ws
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    ymask = mmask[:, None] & nmask[None, :]
    if ADD:
        acc += tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


def sgmv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
         tile_slot: torch.Tensor, tile_start: torch.Tensor, tile_len: torch.Tensor, add: bool) -> None:
    """y[rows of each tile] (+)= x[those rows] @ w[tile's slot]^T. x [T, K] and y [T, N] with
    unit column stride (y may be a column slice); w [slots, N, K] contiguous."""
    n, k = w.shape[1], w.shape[2]
    assert x.stride(1) == 1 and y.stride(1) == 1 and w.is_contiguous()
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (tile_len.shape[0], triton.cdiv(n, block_n))
    _sgmv_kernel[grid](x, w, y, rows, tile_slot, tile_start, tile_len, n, k,
                       x.stride(0), w.stride(0), w.stride(1), y.stride(0),
                       ADD=add, IEEE=x.dtype == torch.float32,
                       BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
