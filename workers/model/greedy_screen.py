"""Greedy tokens from a float32 LM head at bf16 cost, with the float32 path's exact argmax.

Why: in float32, a decode step's LM head (vocabulary x hidden, for every row)
is a sixth of the step on the demo model, and a greedy row only needs its
argmax. The screen scores all tokens with bf16 copies of the row and the head
(gemm.c: vdpbf16ps, float32 accumulation and output, about twice the float32
rate), bounds how far each score can be from the float32 logit, and hands
the few tokens whose bound reaches the best lower bound to greedy.c, which
computes their float32 logits exactly as the full GEMM does and returns the
first maximum. So the token equals the full path's token for every row, ties
included; nothing about the model's numerics changes.

The bound, per row x and head row w_v (hat: rounded to bf16, denormals flushed
as vdpbf16ps flushes them; norms are Euclidean, gamma = K u / (1 - K u) with
u = 2^-24 covers one float32 chain of K additions):
    |s_v - f_v| <= |w_v| |x - x^| + |w_v - w_v^| |x^|       (the roundings, Cauchy-Schwarz)
                 + gamma |w_v^| |x^| + gamma |w_v| |x|        (the screen's and the exact chain's sums)
              <= alpha wn_v + beta dn_v,
    alpha = |x - x^| + gamma (|x^| + |x|),  beta = |x^| (1 + gamma)
(|w_v^| <= wn_v + dn_v); wn, dn (here) and alpha, beta (greedy.c, per row) are each
inflated by 0.1% for their own float rounding. greedy.c adds 2^-20 of the row's
magnitude for its float32 comparisons, and K 2^-100 for products flushed as denormals.
"""
from __future__ import annotations

import torch

from .. import cpu_ops

_TINY = 2.0 ** -126  # vdpbf16ps treats bf16 inputs below float32's normal range as zero
_SAFE = 1.001     # margin for rounding the bound's own terms


def _bf16_flushed(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bf16 (nearest-even), then as float64 with denormals flushed."""
    r = t.to(torch.bfloat16).double()
    return torch.where(r.abs() < _TINY, torch.zeros_like(r), r)


class GreedyScreen:
    """Built once per model (float32 weights, bf16 GEMM available): the head's bf16
    tiles and per-row norms. `exact` is where greedy.c reads exact rows, through
    `strides`: a row-major [V, K] float32 tensor (a tied embedding) or gemm.c's float32
    tiles."""

    def __init__(self, ops: "cpu_ops.CpuOps", dense: torch.Tensor, exact: torch.Tensor,
                 strides: tuple[int, int, int]) -> None:
        v = dense.shape[0]
        self.ops = ops
        self.exact, self.strides = exact, strides
        self.head_bf16 = cpu_ops.GemmWeight.pack(dense.to(torch.bfloat16))
        wn = torch.empty(v, dtype=torch.float64)
        dn = torch.empty(v, dtype=torch.float64)
        for i in range(0, v, 4096):  # float64 copies of the whole head would be 8 bytes a weight
            rows = dense[i:i + 4096].double()
            wn[i:i + 4096] = rows.norm(dim=1)
            dn[i:i + 4096] = (rows - _bf16_flushed(dense[i:i + 4096])).norm(dim=1)
        self.wn = (wn * _SAFE).float().contiguous()
        self.dn = (dn * _SAFE).float().contiguous()

    @classmethod
    def build(cls, ops, dense: torch.Tensor, packed: "cpu_ops.GemmWeight | None") -> "GreedyScreen | None":
        """From the head's float32 values: exact rows read from `dense` itself when it is the
        row-major matrix the full GEMM uses bit for bit (a tied embedding), else from
        `packed` when it holds dense float32 tiles; None when neither (e.g. a quantized,
        untied head)."""
        if ops is None or not ops.has_gemm(torch.bfloat16) or dense.dtype != torch.float32 \
                or dense.dim() != 2 or not dense.is_contiguous():
            return None
        v, k = dense.shape
        if packed is None or packed.bits:
            if packed is not None and (packed.n, packed.k) != (v, k):
                return None
            return cls(ops, dense, dense, (64 * k, k, 1))
        if packed.packed.dtype != torch.float32 or (packed.n, packed.k) != (v, k):
            return None
        return cls(ops, dense, packed.packed, (64 * k, 1, 64))

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 argmax of x @ head^T per row of x [n, K] (float32, the normed hidden
        states); -1 where the row needs the full GEMM (non-finite scores). greedy.c derives
        each row's alpha and beta from x and its bf16 copy."""
        xb = x.to(torch.bfloat16)
        scores = self.ops.gemm(xb, self.head_bf16, out_f32=True)
        return self.ops.greedy_refine(x, xb, scores, self.wn, self.dn, self.exact, self.strides)
