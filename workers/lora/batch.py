"""One step's adapters: which slot each token row uses, and the batched LoRA per projection.

Rows are grouped by adapter (rows of the base model take no part); each projection
then costs one shrink and one expand over the whole batch: on CUDA one launch each
of the SGMV kernels (triton_lora.py), on the CPU one call of the C kernel lora.c for
all groups (on the kernels' own thread team; it reads only each adapter's own rank and
B's blocks of a fused projection's slices). The sorted rows, group offsets, slots and
ranks are built once per step. Without the C kernels (KVYARD_CPU_KERNELS=0, no
compiler) the CPU runs one pair of torch GEMMs per adapter group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cpu_ops.lora_args import LoraGroups, LoraWeights

NO_SLOT = -1


def _groups(row_slots: list[int]) -> list[tuple[int, list[int]]]:
    by: dict[int, list[int]] = {}
    for r, s in enumerate(row_slots):
        if s != NO_SLOT:
            by.setdefault(s, []).append(r)
    return sorted(by.items())


@dataclass(slots=True)
class TileTable:
    """SGMV metadata on the device: rows sorted by slot, tiles of <= block_m rows, padded
    with empty tiles to cdiv(T, block_m) + slots entries."""

    rows: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor

    @classmethod
    def build(cls, groups: list[tuple[int, list[int]]], num_rows: int, num_slots: int,
              device: torch.device, block_m: int) -> "TileTable":
        rows, slot, start, length = cls.lists(groups, num_rows, num_slots, block_m)
        t = torch.tensor(rows or [0], dtype=torch.int32)
        meta = torch.tensor([slot, start, length], dtype=torch.int32)
        return cls(t.to(device, non_blocking=True), *meta.to(device, non_blocking=True).unbind(0))

    @staticmethod
    def lists(groups: list[tuple[int, list[int]]], num_rows: int, num_slots: int, block_m: int
              ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The table's host lists: (rows, tile slot, tile start, tile length), padded."""
        rows: list[int] = []
        slot, start, length = [], [], []
        for s, rs in groups:
            for i in range(0, len(rs), block_m):
                slot.append(s)
                start.append(len(rows) + i)
                length.append(min(block_m, len(rs) - i))
            rows.extend(rs)
        pad = -(-num_rows // block_m) + num_slots - len(slot)
        slot += [0] * pad
        start += [0] * pad
        length += [0] * pad
        rows += [0] * (num_rows - len(rows))
        return rows, slot, start, length


@dataclass(slots=True)
class CpuLoRA:
    """lora.c's side of the manager: the kernels, the stacks as its checked operands
    (`weights[layer][proj]`; B stored transposed for it) and per projection the rank of
    each slot's adapter there (0: that adapter leaves the projection alone)."""

    kernels: Any                                   # workers.cpu_ops.CpuOps
    weights: list[dict[str, LoraWeights]]
    ranks: dict[str, list[int]]

    def groups(self, groups: list[tuple[int, list[int]]], projs: frozenset[str],
               num_rows: int) -> dict[str, LoraGroups]:
        """A step's metadata per projection: rows sorted by adapter, group offsets, slots
        and ranks, and one float32 scratch for the shrunk rows, all projections' alike."""
        rows = [r for _, rs in groups for r in rs]
        start = [0]
        for _, rs in groups:
            start.append(start[-1] + len(rs))
        slots = [s for s, _ in groups]
        order = sorted(projs)
        meta = torch.tensor([slots] + [[self.ranks[p][s] for s in slots] for p in order], dtype=torch.int32)
        rows_t, start_t = torch.tensor(rows, dtype=torch.int32), torch.tensor(start, dtype=torch.int32)
        mid = torch.empty(len(rows), max(w.a.shape[1] for w in self.weights[0].values()), dtype=torch.float32)
        return {p: LoraGroups.prepare(rows_t, start_t, meta[0], meta[i + 1], mid, num_rows)
                for i, p in enumerate(order)}


@dataclass(slots=True)
class LoRABatch:
    """`stacks[layer][proj]` = (A [slots, R, in], B [slots, out, R]) of the manager's slots."""

    row_slots: list[int]
    stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    projs: frozenset[str]                  # projections some adapter of the batch changes
    num_slots: int
    groups: list[tuple[int, list[int]]] = field(default_factory=list)
    index: list[torch.Tensor] = field(default_factory=list)   # CPU torch path: each group's rows
    tiles: TileTable | None = None         # CUDA
    cpu_lora: CpuLoRA | None = None        # CPU: lora.c's part, or None (torch per group)
    cpu: dict[str, LoraGroups] | None = None   # CPU with lora.c: the step's groups per projection
    captured: bool = False                 # a CUDA graph's batch: its tile table is filled at each replay

    @classmethod
    def build(cls, row_slots: list[int], stacks, projs: frozenset[str], num_slots: int,
              device: torch.device, cpu_lora: CpuLoRA | None = None) -> "LoRABatch":
        groups = _groups(row_slots)
        b = cls(row_slots, stacks, projs, num_slots, groups, cpu_lora=cpu_lora)
        if device.type == "cuda":
            from .triton_lora import BLOCK_M

            b.tiles = TileTable.build(groups, len(row_slots), num_slots, device, BLOCK_M)
        elif cpu_lora is not None:
            b.cpu = cpu_lora.groups(groups, projs, len(row_slots))
        else:
            b.index = [torch.tensor(rs, dtype=torch.int64) for _, rs in groups]
        return b

    def select(self, rows: torch.Tensor) -> "LoRABatch":
        """The batch narrowed to `rows` (the model keeps only the sampled rows after the
        last layer's attention)."""
        picked = [self.row_slots[r] for r in rows.tolist()]
        dev = self.tiles.rows.device if self.tiles is not None else torch.device("cpu")
        return LoRABatch.build(picked, self.stacks, self.projs, self.num_slots, dev, self.cpu_lora)

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the batch's LoRA delta of `proj` for input x, row by row (in place)."""
        if proj not in self.projs or not (self.groups or self.captured):
            return
        a, b = self.stacks[layer][proj]
        if self.tiles is not None:
            from .triton_lora import lora_delta

            t = self.tiles
            lora_delta(x, a, b, y, t.rows, t.tile_slot, t.tile_start, t.tile_len)
            return
        if self.cpu is not None:
            self.cpu_lora.kernels.lora_sgmv(x if x.stride(1) == 1 else x.contiguous(), y,
                                            self.cpu_lora.weights[layer][proj], self.cpu[proj])
            return
        apply_groups(x, y, a, b, self.groups, self.index)


def apply_groups(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 groups: list[tuple[int, list[int]]], index: list[torch.Tensor]) -> None:
    """The torch path (CPU, and the GPU bench's per-adapter loop): per adapter group one
    shrink and one expand; a group that is one contiguous run of rows is sliced, not gathered."""
    for (s, rs), idx in zip(groups, index):
        lo, hi = rs[0], rs[-1] + 1
        if hi - lo == len(rs):
            xs = x[lo:hi]
            y[lo:hi] += (xs @ a[s].t()) @ b[s].t()
        else:
            y.index_add_(0, idx, (x.index_select(0, idx) @ a[s].t()) @ b[s].t())
