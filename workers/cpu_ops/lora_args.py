"""lora.c's operands, checked once so that a call per projection checks only its
activations: a projection's stacked weights (at the LoRA manager's start; the stacks
never move) and a step's adapter groups (once per step, one per projection)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = (torch.bfloat16, torch.float32)


def _int32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous() for t in ts)


@dataclass(slots=True)
class LoraWeights:
    """A [slots, R, K] contiguous and B [slots, N, R] stored transposed (B.transpose(1, 2)
    contiguous), bf16 or float32; `noff` (int32) the nsl + 1 slice boundaries in N of a
    fused projection: slice j owns ranks [j R/nsl, (j + 1) R/nsl) and is B's only block
    in its columns (the adapter loader's layout)."""

    a: torch.Tensor
    b: torch.Tensor
    noff: torch.Tensor
    args: tuple[int, ...]   # lora_sgmv's weight arguments

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    @classmethod
    def prepare(cls, a: torch.Tensor, b: torch.Tensor, noff: torch.Tensor) -> "LoraWeights":
        if a.dim() != 3 or b.dim() != 3:
            raise ValueError("lora weights: A [slots, R, K] and B [slots, N, R] expected")
        (s, r, k), n, nsl = a.shape, b.shape[1], noff.shape[0] - 1
        if a.dtype not in _DTYPES or b.dtype != a.dtype or tuple(b.shape) != (s, n, r) or not a.is_contiguous() \
                or not b.transpose(1, 2).is_contiguous() or not _int32(noff) or nsl < 1 or r % nsl \
                or noff[0] != 0 or noff[-1] != n or bool((noff[1:] < noff[:-1]).any()):
            raise ValueError("lora weights: unexpected layout (bf16/float32 A [slots, R, K] contiguous, "
                             "B [slots, N, R] stored transposed, int32 slice boundaries 0..N)")
        return cls(a, b, noff, (a.data_ptr(), b.data_ptr(), noff.data_ptr(), k, r, n, nsl))


@dataclass(slots=True)
class LoraGroups:
    """A step's rows (of `num_rows`) by adapter for one projection: group g is
    rows[gstart[g]:gstart[g + 1]] on slot gslot[g] with rank grank[g] per slice there;
    `mid` float32 [len(rows), >= R] scratch (may be shared by the step's projections)."""

    rows: torch.Tensor
    gstart: torch.Tensor
    gslot: torch.Tensor
    grank: torch.Tensor
    mid: torch.Tensor
    num_rows: int
    args: tuple[int, ...]   # lora_sgmv's group arguments

    @classmethod
    def prepare(cls, rows: torch.Tensor, gstart: torch.Tensor, gslot: torch.Tensor, grank: torch.Tensor,
                mid: torch.Tensor, num_rows: int) -> "LoraGroups":
        g = gslot.shape[0]
        if not _int32(rows, gstart, gslot, grank) or gstart.shape[0] != g + 1 or grank.shape[0] != g \
                or (g and (gstart[0] != 0 or gstart[-1] != rows.shape[0])) \
                or (rows.numel() and (rows.min() < 0 or rows.max() >= num_rows)) \
                or mid.dtype != torch.float32 or mid.dim() != 2 or mid.stride(1) != 1 \
                or mid.shape[0] < rows.shape[0]:
            raise ValueError("lora groups: unexpected metadata")
        return cls(rows, gstart, gslot, grank, mid, num_rows,
                   (rows.data_ptr(), gstart.data_ptr(), gslot.data_ptr(), grank.data_ptr(), mid.data_ptr(),
                    mid.stride(0), g))
