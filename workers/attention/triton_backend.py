"""`AttentionBackend` over the Triton kernels, for today's `AttentionMetadata`.

Per layer: write the new K/V by slot mapping, then the first `num_decodes`
sequences go through `paged_decode` and the rest (prefill chunks, prefix
hits) through `paged_prefill`, both reading the cache in place. The
metadata's host lists become device tensors once per step (the first layer
builds them into `meta.scratch`); an engine that captures CUDA graphs keeps
such tensors persistent itself and calls the kernels directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import AttentionMetadata
from .triton_decode import paged_decode
from .triton_kv_write import write_kv
from .triton_prefill import paged_prefill

_KEY = "triton"


@dataclass(slots=True)
class _DevicePlan:
    slots: torch.Tensor          # [T] int64
    tables: torch.Tensor         # [B, max_blocks] int32
    lens: torch.Tensor           # [B] int32
    query_start: torch.Tensor    # [B+1] int32
    max_prefill_len: int


def _plan(meta: AttentionMetadata, device: torch.device) -> _DevicePlan:
    qsl = meta.query_start_loc
    nd = meta.num_decodes
    new = [qsl[i + 1] - qsl[i] for i in range(nd, meta.num_seqs)]
    return _DevicePlan(
        slots=meta.slot_mapping.to(device=device, dtype=torch.int64),
        tables=meta.block_tables.to(device=device, dtype=torch.int32).contiguous(),
        lens=torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_prefill_len=max(new, default=0),
    )


class TritonBackend:
    """Paged attention on GPU tensors (or anywhere under TRITON_INTERPRET=1)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = meta.scratch.get(_KEY)
        if plan is None:
            plan = meta.scratch[_KEY] = _plan(meta, q.device)
        write_kv(k, v, kv_cache, plan.slots)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode(q[:nd], kv_cache, plan.tables[:nd], plan.lens[:nd], scale, out=out[:nd])
        if nd < meta.num_seqs:
            paged_prefill(q, kv_cache, plan.tables[nd:], plan.query_start[nd:], plan.lens[nd:], scale,
                          max_query_len=plan.max_prefill_len, out=out)
        return out
