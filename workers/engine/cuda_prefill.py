"""CUDA graphs of one sequence's prefill or extend step, per padded token count.

Why: a prefill step of a few hundred tokens launches the same ~300 kernels as a decode
step; on a small model, or a short extend (a multi-turn follow-up over a cached prefix,
a chunk of a long prompt), launching them from Python costs as much as computing them.
A step whose batch is one sequence bringing `n` new tokens, `n` up to the largest bucket,
replays the graph of the smallest bucket `t >= n` (16, 32, ... up to the step budget).

Padding: tokens n..t-1 belong to no sequence. Their slots are -1 (the KV write skips
them), the attention's query_start_loc is [0, n], so the prefill kernel's tiles past n
exit at once and those rows' outputs are never read: every other op is row-independent,
and only row n-1's hidden state reaches the LM head (`out_rows`). The kernel's grid
depends on the bucket alone (max_query_len = t), never on values, which is what makes it
capturable. Steps with decodes, several sequences or prompt logprobs run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvyard.workers.attention import AttentionMetadata
from kvyard.workers.attention.triton_backend import TRITON_PLAN_KEY, DevicePlan

from .cuda_runner import capture_graph


def prefill_buckets(max_tokens: int) -> list[int]:
    """16, 32, ... doubling, up to `max_tokens` (the step budget), which is always the last."""
    sizes, t = [], 16
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return sizes + [max_tokens]


@dataclass(slots=True)
class _Buffers:
    ids: torch.Tensor     # [T] int64
    pos: torch.Tensor     # [T] int64
    slots: torch.Tensor   # [T] int64, -1 = padding
    lens: torch.Tensor    # [1] int32: context length after the step
    tables: torch.Tensor  # [1, max_blocks] int32
    qsl: torch.Tensor     # [2] int32: [0, n]
    last: torch.Tensor    # [1] int64: n - 1, the row whose logits are wanted

    @classmethod
    def allocate(cls, tokens: int, max_blocks: int, device: Any) -> "_Buffers":
        def t(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(t(tokens, dtype=torch.int64), t(tokens, dtype=torch.int64), t(tokens, dtype=torch.int64),
                   t(1, dtype=torch.int32), t(1, max_blocks, dtype=torch.int32), t(2, dtype=torch.int32),
                   t(1, dtype=torch.int64))

    def pinned(self) -> "_Buffers":
        return _Buffers(*(x.pin_memory() for x in (self.ids, self.pos, self.slots, self.lens, self.tables,
                                                    self.qsl, self.last)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.pos, self.slots, self.lens, self.tables, self.qsl, self.last


class PrefillGraphs:
    """One graph per bucket over persistent buffers; `capture=False` runs the same padded
    step eagerly (what the graphs replay), so its semantics are testable without CUDA."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], max_tokens: int, max_blocks: int,
                 capture: bool = True) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = prefill_buckets(max_tokens)
        self.max_tokens, self.max_blocks = self.sizes[-1], max_blocks
        dev = torch.device(getattr(model, "device", "cpu"))
        self.dev = _Buffers.allocate(self.max_tokens, max_blocks, dev)
        host = _Buffers.allocate(self.max_tokens, max_blocks, "cpu")
        self.host = host.pinned() if dev.type == "cuda" else host
        self.fns = {t: self._step_fn(t) for t in self.sizes}
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        if capture:
            self._capture()

    def _step_fn(self, t: int):
        d = self.dev
        meta = AttentionMetadata(slot_mapping=d.slots[:t], query_start_loc=[0, t], seq_lens=[t],
                                 block_tables=d.tables, num_decodes=0)
        meta.scratch[TRITON_PLAN_KEY] = DevicePlan(d.slots[:t], d.tables, d.lens, d.qsl, t, d.pos[:t])
        model, caches = self.model, self.kv_caches

        def fn() -> torch.Tensor:
            return model.compute_logits(model(d.ids[:t], d.pos[:t], caches, meta, d.last))

        return fn

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        self.dev.slots.fill_(-1)  # the warm-up runs write nothing to the cache
        for t in reversed(self.sizes):  # largest first: the smaller ones fit in its pool
            self.graphs[t] = capture_graph(self.fns[t], pool, side)
        torch.cuda.synchronize()

    def fits(self, tokens: int, width: int) -> bool:
        return tokens <= self.max_tokens and width <= self.max_blocks

    @torch.inference_mode()
    def run(self, ids: list[int], pos: list[int], slots: list[int], seq_len: int, table: list[int]) -> torch.Tensor:
        """Logits [1, V] float32 of the step's last token (valid until the next run)."""
        n = len(ids)
        t = next(s for s in self.sizes if s >= n)
        h, d = self.host, self.dev
        h.ids[:n] = torch.tensor(ids, dtype=torch.int64)
        h.pos[:t] = 0
        h.pos[:n] = torch.tensor(pos, dtype=torch.int64)
        h.slots[:t] = -1
        h.slots[:n] = torch.tensor(slots, dtype=torch.int64)
        h.lens[0] = seq_len
        h.tables[0, :len(table)] = torch.tensor(table, dtype=torch.int32)
        h.qsl[1] = n
        h.last[0] = n - 1
        for src, dst in zip(h.tensors(), d.tensors()):
            if src is h.tables:
                dst[:, :len(table)].copy_(src[:, :len(table)], non_blocking=True)
            elif src.shape[0] == self.max_tokens:
                dst[:t].copy_(src[:t], non_blocking=True)
            else:
                dst.copy_(src, non_blocking=True)
        if t in self.graphs:
            graph, out = self.graphs[t]
            graph.replay()
            return out
        return self.fns[t]()
