"""The CPU batched LoRA step (workers/cpu_ops/lora.c) against a float64 reference and
the torch path (batch.apply_groups): ranks 4/8/16 in one batch, base rows, groups that
are not contiguous, a group long enough to be split over threads, fused projections of
several slices with widths and K that are no multiple of the vector width, bf16 and
float32, the build for this CPU and the portable one. The padding a kernel must not
read (ranks past an adapter's own, B's blocks of other slices) is NaN here, so reading
it shows."""
from __future__ import annotations

import pytest
import torch

from kvyard.workers.cpu_ops import load
from kvyard.workers.cpu_ops.lora_args import LoraGroups, LoraWeights
from kvyard.workers.lora.batch import NO_SLOT, CpuLoRA, LoRABatch, _groups, apply_groups

RMAX = 16
RANKS = [4, 8, 16, 16, 0]          # per slot; 0: the adapter leaves this projection alone
K = 91                              # whole vectors (of 16 or 8) and a tail
NOFF = [0, 100, 136, 172]           # three slices (q/k/v-like), none a whole number of vectors
ROWS = [0, NO_SLOT, 2, 0, 1, 3, 3, NO_SLOT, 2, 0, 4, 1] + [3] * 40 + [0, NO_SLOT, 2]


def _kernels(portable: bool):
    k = load(portable)
    assert k is not None, "the C kernels must build here (a C compiler is part of the test setup)"
    return k


def _stacks(dtype: torch.dtype, noff: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B) as lora.c takes them, NaN where nothing may be read, and the zero-padded
    (A, B) the adapter loader would store, for the references."""
    g = torch.Generator().manual_seed(0)
    nsl, n = len(noff) - 1, noff[-1]
    a = torch.full((len(RANKS), nsl * RMAX, K), float("nan"))
    b = torch.full((len(RANKS), n, nsl * RMAX), float("nan"))
    a0, b0 = torch.zeros(a.shape), torch.zeros(b.shape)
    for s, r in enumerate(RANKS):
        for j in range(nsl):
            cols = slice(j * RMAX, j * RMAX + r)
            a0[s, cols] = torch.randn(r, K, generator=g)
            b0[s, noff[j]:noff[j + 1], cols] = torch.randn(noff[j + 1] - noff[j], r, generator=g) * 0.1
            a[s, cols] = a0[s, cols]
            b[s, noff[j]:noff[j + 1], cols] = b0[s, noff[j]:noff[j + 1], cols]
    a, a0, b0 = a.to(dtype), a0.to(dtype), b0.to(dtype)
    b = b.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)  # stored transposed, as the manager does
    return a, b, a0, b0


def _batch(kernels, a, b, noff: list[int], row_slots: list[int]) -> LoRABatch:
    w = LoraWeights.prepare(a, b, torch.tensor(noff, dtype=torch.int32))
    lora = CpuLoRA(kernels, [{"qkv": w}], {"qkv": list(RANKS)})
    batch = LoRABatch.build(row_slots, [{"qkv": (a, b)}], frozenset({"qkv"}), len(RANKS), torch.device("cpu"), lora)
    assert batch.cpu is not None
    return batch


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_float64_and_the_torch_path(portable: bool, dtype: torch.dtype, threads: int) -> None:
    kernels = _kernels(portable)
    a, b, a0, b0 = _stacks(dtype, NOFF)
    g = torch.Generator().manual_seed(1)
    t = len(ROWS)
    x = torch.randn(t, K, generator=g).to(dtype)
    y0 = torch.randn(t, NOFF[-1], generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = y0.clone()
        _batch(kernels, a, b, NOFF, ROWS).apply(0, "qkv", x, y)
    finally:
        torch.set_num_threads(before)
    ref = y0.double()
    for r, s in enumerate(ROWS):
        if s != NO_SLOT:
            ref[r] += (x[r].double() @ a0[s].double().t()) @ b0[s].double().t()
    yt = y0.clone()
    groups = _groups(ROWS)
    apply_groups(x, yt, a0, b0, groups, [torch.tensor(rs) for _, rs in groups])
    err, err_torch = (y.double() - ref).abs(), (yt.double() - ref).abs()
    assert torch.isfinite(y).all()
    if dtype == torch.float32:
        assert err.max() < 1e-4, err.max()
    else:  # one rounding of y to bf16 (2^-9 relative) and float32 sums
        assert (err <= ref.abs() * 2 ** -8 + 1e-3).all(), err.max()
    assert err.max() <= err_torch.max() * 1.01 + 1e-6
    base = [r for r, s in enumerate(ROWS) if s == NO_SLOT or RANKS[s] == 0]
    assert torch.equal(y[base], y0[base])   # rows of the base model, and a rank-0 adapter's, untouched
    assert not torch.equal(y, y0)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_single_slice_and_the_narrowed_batch(portable: bool) -> None:
    """One slice (o/down-like), wider than a 64-column tile; LoRABatch.select keeps lora.c."""
    kernels = _kernels(portable)
    noff = [0, 200]
    a, b, a0, b0 = _stacks(torch.float32, noff)
    t = len(ROWS)
    x, y0 = torch.randn(t, K), torch.randn(t, 200)
    picked = torch.tensor([2, 5, 20, 54])
    narrowed = _batch(kernels, a, b, noff, ROWS).select(picked)
    assert narrowed.cpu is not None
    y = y0[picked].clone()
    narrowed.apply(0, "qkv", x[picked], y)
    for i, r in enumerate(picked.tolist()):
        s = ROWS[r]
        want = y0[r].double() + (x[r].double() @ a0[s].double().t()) @ b0[s].double().t()
        assert (y[i].double() - want).abs().max() < 1e-4


def test_bad_operands_are_refused() -> None:
    kernels = _kernels(False)
    a, b, _, _ = _stacks(torch.float32, NOFF)
    noff = torch.tensor(NOFF, dtype=torch.int32)
    with pytest.raises(ValueError):
        LoraWeights.prepare(a, b.contiguous(), noff)              # B not stored transposed
    with pytest.raises(ValueError):
        LoraWeights.prepare(a, b, torch.tensor([0, 136, 100, 172], dtype=torch.int32))  # not in order
    with pytest.raises(ValueError):
        LoraWeights.prepare(a, b, torch.tensor([0, 100, 136, 170], dtype=torch.int32))  # does not end at N
    batch = _batch(kernels, a, b, NOFF, ROWS)
    t = len(ROWS)
    y = torch.zeros(t, NOFF[-1])
    with pytest.raises(ValueError):
        batch.apply(0, "qkv", torch.zeros(t, K, dtype=torch.bfloat16), y)     # dtype
    with pytest.raises(ValueError):
        batch.apply(0, "qkv", torch.zeros(t, K + 1), y)                        # K
    with pytest.raises(ValueError):
        batch.apply(0, "qkv", torch.zeros(t, K), torch.zeros(t, 2 * NOFF[-1])[:, ::2])   # y's columns strided
    i32 = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError):  # a row past the step's rows
        LoraGroups.prepare(torch.tensor([7], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), i32, i32,
                           torch.empty(1, 48), num_rows=4)
