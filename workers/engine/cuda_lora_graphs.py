"""Decode steps with LoRA adapters replayed from CUDA graphs.

A step whose batch has adapter rows adds each projection's delta through the SGMV
kernels (workers/lora/triton_lora.py), whose launches depend on shapes only: the
adapters' weights sit in the manager's stacked per-slot tensors (fixed addresses,
filled in place when an adapter takes a slot) and the tile table has a fixed length
per batch size. So a graph per padded batch size captures the step with every
projection's delta (a slot holds zeros for the projections its adapter leaves alone,
so applying all of them is exact), and each replay only rewrites the tile table.

A worker started with `--enable-lora` captures every batch size's graph at start, beside
the plain decode graphs (model_runner.capture_lora_graphs), as vLLM does: captured at the
first step of each new batch size instead, a capture stalls every running request (on an
H200, serving 32 streams over 4 adapters, TTFT p99 1.26 s against 0.14 s without LoRA).
They are captured as the plain graphs are (DecodeGraphs._capture, largest first, one pool);
a wake from sleep recaptures them with the other graphs (model_runner.rebuild_device_state).
"""
from __future__ import annotations

from typing import Any

import torch

from kvyard.workers.lora.batch import NO_SLOT, LoRABatch, TileTable, _groups
from kvyard.workers.lora.triton_lora import BLOCK_M

from .cuda_runner import DecodeGraphs, graph_batch_sizes


class LoRADecodeGraphs(DecodeGraphs):
    """DecodeGraphs whose steps carry a LoRABatch over all of the manager's slots."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], max_batch: int, max_blocks: int,
                 manager: Any) -> None:
        self.manager = manager
        self.num_slots = len(manager.slot_names)
        self.projs = frozenset(manager.stacks[0]) if manager.stacks else frozenset()
        top = graph_batch_sizes(max_batch)[-1]
        tiles = self._tiles_for(top)
        dev = model.device
        self.tile_dev = TileTable(*(torch.zeros(n, dtype=torch.int32, device=dev) for n in (top, tiles, tiles, tiles)))
        self.tile_host = [torch.zeros(n, dtype=torch.int32).pin_memory() for n in (top, tiles, tiles, tiles)]
        self._row_slots: list[int] = []
        super().__init__(model, kv_caches, max_batch, max_blocks)

    def _tiles_for(self, b: int) -> int:
        return -(-b // BLOCK_M) + self.num_slots

    def _model_kwargs(self, b: int) -> dict[str, Any]:
        t = self.tile_dev
        nt = self._tiles_for(b)
        tiles = TileTable(t.rows[:b], t.tile_slot[:nt], t.tile_start[:nt], t.tile_len[:nt])
        batch = LoRABatch([NO_SLOT] * b, self.manager.stacks, self.projs, self.num_slots, tiles=tiles,
                          captured=True)
        return {"lora": batch}

    def _fill_extra(self, b: int, rows: int) -> None:
        slots = self._row_slots + [NO_SLOT] * (b - rows)
        nt = self._tiles_for(b)
        lists = TileTable.lists(_groups(slots), b, self.num_slots, BLOCK_M)
        t = self.tile_dev
        for host, dev, vals in zip(self.tile_host, (t.rows, t.tile_slot, t.tile_start, t.tile_len), lists):
            n = b if dev is t.rows else nt
            host[:n] = torch.tensor(vals[:n], dtype=torch.int32)
            dev[:n].copy_(host[:n], non_blocking=True)

    def run_lora(self, ids: list[int], pos: list[int], slots: list[int], lens: list[int],
                 tables: list[list[int]], row_slots: list[int]) -> torch.Tensor:
        """A decode step whose rows use the manager's slots `row_slots` (NO_SLOT: the base model)."""
        self._row_slots = row_slots
        return self.run(ids, pos, slots, lens, tables)
