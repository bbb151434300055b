"""The model runner's CUDA side: decode steps replayed from CUDA graphs over persistent buffers.

Why: at batch 1-64 a decode step of an 8B model is ~300 kernels of a few µs each;
launched from Python they cost more than they compute. A graph per padded batch
size (vLLM's sizes: 1, 2, 4, then multiples of 8 up to the largest) replays the
whole step, embedding to float32 logits, from fixed addresses. So the step's
inputs and its attention metadata live in persistent device tensors sized for
the largest captured batch, filled from pinned host copies each step (one
asynchronous copy each, no sync); padding rows have slot -1 (the KV write
skips them) and length 0 (attention gives zeros). The only host sync of a step
is reading the sampled ids.

The graphs share one memory pool, captured largest first (what vLLM does): they
never run at once, so their intermediates may share memory; the inputs and each
graph's logits are held here, outside what the pool may reuse.

Speculative decoding's verify steps are graphs too (`q` = 1 + k query tokens per row:
a fixed shape per padded batch size, through the extend kernel). A row with a shorter
draft, or a plain decode beside drafted rows, is right-aligned in its q slots: the
padding in front has slot -1 and its queries' output is never read, so each real token
sits at its own position (the kernel places query i at seq_len - q + i).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvyard.workers.attention import AttentionMetadata
from kvyard.workers.attention.triton_backend import TRITON_PLAN_KEY, DevicePlan


def capture_graph(fn: Callable[[], torch.Tensor], pool: Any = None, side: Any = None
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm `fn` up on a side stream (Triton compiles, cuBLAS picks its kernels), then
    capture it into one graph (in `pool` where graphs share one); returns (graph, output)."""
    side = side or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    return sorted(set(sizes + [max_batch]))


@dataclass(slots=True)
class _Buffers:
    """Persistent step inputs on the device, and their pinned host twins."""

    ids: torch.Tensor        # [B] int64
    pos: torch.Tensor        # [B] int64
    slots: torch.Tensor      # [B] int64, -1 = padding
    lens: torch.Tensor       # [B] int32, 0 = padding
    tables: torch.Tensor     # [B, max_blocks] int32
    qsl: torch.Tensor        # [B + 1] int32 (decodes: 0..B)

    @classmethod
    def allocate(cls, batch: int, max_blocks: int, device: Any, q: int = 1) -> "_Buffers":
        def t(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        n = batch * q
        return cls(t(n, dtype=torch.int64), t(n, dtype=torch.int64), t(n, dtype=torch.int64),
                   t(batch, dtype=torch.int32), t(batch, max_blocks, dtype=torch.int32),
                   torch.arange(0, n + 1, q, dtype=torch.int32, device=device))


class DecodeGraphs:
    """CUDA graphs of whole decode steps, one per padded batch size."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], max_batch: int, max_blocks: int,
                 q: int = 1) -> None:
        """`q` query tokens per row: 1 for decode steps, 1 + k for speculative verify steps."""
        self.model, self.kv_caches = model, kv_caches
        dev = model.device
        self.q = q
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch, self.max_blocks = self.sizes[-1], max_blocks
        self.dev = _Buffers.allocate(self.max_batch, max_blocks, dev, q)
        host = _Buffers.allocate(self.max_batch, max_blocks, "cpu", q)
        self.host = _Buffers(*(x.pin_memory() for x in (host.ids, host.pos, host.slots, host.lens,
                                                        host.tables, host.qsl)))
        self.dev.slots.fill_(-1)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]] = {}
        self._capture()

    def _step_fn(self, b: int):
        d, q = self.dev, self.q
        n = b * q
        meta = AttentionMetadata(slot_mapping=d.slots[:n], query_start_loc=list(range(0, n + 1, q)),
                                 seq_lens=[q] * b, block_tables=d.tables[:b], num_decodes=b if q == 1 else 0)
        meta.scratch[TRITON_PLAN_KEY] = DevicePlan(d.slots[:n], d.tables[:b], d.lens[:b], d.qsl[:b + 1],
                                                     0 if q == 1 else q, d.pos[:n])
        model, caches, kw = self.model, self.kv_caches, self._model_kwargs(b)

        def fn() -> torch.Tensor:
            return model.compute_logits(model(d.ids[:n], d.pos[:n], caches, meta, **kw))

        return fn

    def _model_kwargs(self, b: int) -> dict[str, Any]:
        """Extra arguments of the captured forward (LoRA's graphs pass their batch)."""
        return {}

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for b in reversed(self.sizes):
            fn = self._step_fn(b)
            graph, out = capture_graph(fn, pool, side)
            self.graphs[b] = (graph, out, fn)  # fn holds the metadata the graph reads
        torch.cuda.synchronize()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.max_batch and width <= self.max_blocks

    def run(self, ids: list[int], pos: list[int], slots: list[int], lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Logits [n, V] float32 (a view of the graph's output, valid until the next run).
        With q > 1, ids/pos/slots hold q entries per row (padding: slot -1) and the
        logits q rows per row."""
        rows = len(lens)
        n = rows * self.q
        b = next(s for s in self.sizes if s >= rows)
        h, d = self.host, self.dev
        h.ids[:n] = torch.tensor(ids, dtype=torch.int64)
        h.pos[:n] = torch.tensor(pos, dtype=torch.int64)
        h.slots[:b * self.q] = -1
        h.slots[:n] = torch.tensor(slots, dtype=torch.int64)
        h.lens[:b] = 0
        h.lens[:rows] = torch.tensor(lens, dtype=torch.int32)
        tab = h.tables.numpy()
        for i, t in enumerate(tables):
            tab[i, :len(t)] = t
        self._fill_extra(b, rows)
        m = b * self.q
        for src, dst, k in ((h.ids, d.ids, m), (h.pos, d.pos, m), (h.slots, d.slots, m), (h.lens, d.lens, b)):
            dst[:k].copy_(src[:k], non_blocking=True)
        d.tables[:rows].copy_(h.tables[:rows], non_blocking=True)  # whole rows: one contiguous copy
        graph, out, _ = self.graphs[b]
        graph.replay()
        return out[:n]

    def _fill_extra(self, b: int, rows: int) -> None:
        """Copy a subclass's own step inputs to the device before the replay."""

    def run_verify(self, seqs: list[Any], block_size: int) -> tuple[torch.Tensor, list[int]]:
        """A verify step of decodes and drafted rows (`seq.spec_token_ids`, at most q - 1
        each), right-aligned in their q slots. Returns the logits and, in `seqs` order,
        the logits row of each sampled position (1 + draft rows per sequence)."""
        q, bs = self.q, block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        rows: list[int] = []
        for i, seq in enumerate(seqs):
            c = seq.num_computed_tokens
            toks = [seq.token_ids[c]] + seq.spec_token_ids
            pad = q - len(toks)
            ids += [0] * pad + toks
            pos += [0] * pad + list(range(c, c + len(toks)))
            t = seq.block_table
            slots += [-1] * pad + [t[p // bs] * bs + p % bs for p in range(c, c + len(toks))]
            lens.append(c + len(toks))
            rows += range(i * q + pad, (i + 1) * q)
        return self.run(ids, pos, slots, lens, [s.block_table for s in seqs]), rows
