"""The SGMV Triton kernels (workers/lora/triton_lora.py: split-K shrink, expand) against the torch per-adapter path.

Without a GPU under TRITON_INTERPRET=1 (float32 and float16; the interpreter has no
bfloat16); on CUDA in bfloat16 too. A batch mixes base rows (no adapter), adapters
whose rows are scattered, a group longer than one tile, and a slot nobody uses.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is decorated, so before it imports
pytest.importorskip("triton")

from kvyard.workers.lora.batch import NO_SLOT, LoRABatch, TileTable, apply_groups  # noqa: E402
from kvyard.workers.lora.triton_lora import BLOCK_M, LoRATile, _splits, lora_delta  # noqa: E402

if not CUDA:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from triton_interp import patch  # noqa: E402

    patch()

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _rows(n: int, slots: int, gen: torch.Generator) -> list[int]:
    """Per-row slots: every third row the base model, the rest scattered over slots - 1 adapters."""
    out = [NO_SLOT if i % 3 == 0 else int(torch.randint(0, slots - 1, (1,), generator=gen)) for i in range(n)]
    out[-BLOCK_M - 3:] = [0] * (BLOCK_M + 3)  # one group longer than a tile
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_rows,k_in", [(1, 96), (7, 96), (40, 96), (7, 1100)])
def test_sgmv_shrink_expand_equals_torch_loop(dtype, n_rows, k_in):
    """k_in 1100: the shrink splits K over programs (the last split partial), expand sums them."""
    gen = torch.Generator().manual_seed(n_rows)
    slots, r, n_out = 4, 24, 80   # r not a power of two: masked tiles
    assert (_splits(k_in)[0] > 1) == (k_in > 1000)
    x = torch.randn(n_rows, k_in, generator=gen)
    a = torch.randn(slots, r, k_in, generator=gen) * 0.1
    b = torch.randn(slots, n_out, r, generator=gen) * 0.1
    row_slots = _rows(n_rows, slots, gen) if n_rows > BLOCK_M else [0, NO_SLOT, 2, 0, 1, NO_SLOT, 2][:n_rows]
    y0 = torch.randn(n_rows, n_out + 8, generator=gen)
    ref = y0.double().clone()
    batch = LoRABatch.build(row_slots, [], frozenset(), slots, torch.device("cpu"))
    apply_groups(x.double(), ref[:, 4:4 + n_out], a.double(), b.double(), batch.groups, batch.index)

    xd, ad, bd = (t.to(DEV, dtype) for t in (x, a, b))
    y = y0.to(DEV, dtype, copy=True)
    t = TileTable.build(batch.groups, n_rows, slots, DEV, BLOCK_M)
    lora_delta(xd, ad, bd, y[:, 4:4 + n_out], t.rows, t.tile_slot, t.tile_start, t.tile_len)
    got = y.double().cpu()
    err = (got - ref).norm() / ref.norm()
    assert err < TOL[dtype], err
    base = [i for i, s in enumerate(row_slots) if s == NO_SLOT]
    # base rows and the columns outside the slice are untouched, bit for bit
    assert torch.equal(got[base], y0.to(dtype).double()[base])
    assert torch.equal(got[:, :4], y0.to(dtype).double()[:, :4])
    if len(base) < n_rows:
        assert (got - y0.to(dtype).double()).abs().max() > 0.01  # the delta is there


def test_tile_table_pads_to_a_fixed_length():
    groups = [(0, list(range(BLOCK_M + 1))), (3, [BLOCK_M + 2])]
    t = TileTable.build(groups, BLOCK_M + 3, 4, torch.device("cpu"), BLOCK_M)
    assert t.tile_len.shape[0] == -(-(BLOCK_M + 3) // BLOCK_M) + 4
    assert t.tile_len.tolist()[:3] == [BLOCK_M, 1, 1] and not any(t.tile_len.tolist()[3:])
    assert t.tile_slot.tolist()[:3] == [0, 0, 3]


def test_every_launch_tile_gives_the_same_delta():
    """gpu_lora_tune's tiles change how the work is cut, never the result."""
    gen = torch.Generator().manual_seed(5)
    slots, r, k_in, n_out, n_rows = 3, 16, 1100, 80, 20
    x = torch.randn(n_rows, k_in, generator=gen)
    a = torch.randn(slots, r, k_in, generator=gen) * 0.1
    b = torch.randn(slots, n_out, r, generator=gen) * 0.1
    row_slots = [i % slots for i in range(n_rows)]
    batch = LoRABatch.build(row_slots, [], frozenset(), slots, torch.device("cpu"))
    t = TileTable.build(batch.groups, n_rows, slots, DEV, BLOCK_M)
    outs = []
    for tile in (LoRATile(), LoRATile(256, 16, 2, 8), LoRATile(1024, 128, 8, 2)):
        y = torch.zeros(n_rows, n_out, device=DEV)
        lora_delta(x.to(DEV), a.to(DEV), b.to(DEV), y, t.rows, t.tile_slot, t.tile_start, t.tile_len, tile)
        outs.append(y.double().cpu())
    ref = outs[0]
    assert ref.abs().max() > 0.01
    for o in outs[1:]:
        assert (o - ref).norm() / ref.norm() < 1e-5
