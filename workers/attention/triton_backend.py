"""`AttentionBackend` over the Triton kernels, for today's `AttentionMetadata`.

Per layer: write the new K/V by slot mapping, then the first `num_decodes`
sequences go through `paged_decode` and the rest (prefill chunks, prefix
hits) through `paged_prefill`, both reading the cache in place. The
metadata's host lists become device tensors once per step (the first layer
builds them into `meta.scratch`); an engine that captures CUDA graphs puts a
`DevicePlan` over its own persistent tensors there instead
(workers/engine/cuda_runner.py), so every replay reads the same addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import AttentionMetadata
from .triton_decode import paged_decode
from .triton_kv_write import rope_write_kv, write_kv
from .triton_prefill import paged_prefill

TRITON_PLAN_KEY = "triton"


@dataclass(slots=True)
class DevicePlan:
    """The step's metadata as device tensors, in the form the kernels take."""

    slots: torch.Tensor          # [T] int64
    tables: torch.Tensor         # [B, max_blocks] int32
    lens: torch.Tensor           # [B] int32
    query_start: torch.Tensor    # [B+1] int32
    max_prefill_len: int
    positions: torch.Tensor | None = None  # [T] int64, for RoPE in the KV write


def _plan(meta: AttentionMetadata, device: torch.device) -> DevicePlan:
    qsl = meta.query_start_loc
    nd = meta.num_decodes
    new = [qsl[i + 1] - qsl[i] for i in range(nd, meta.num_seqs)]
    return DevicePlan(
        slots=meta.slot_mapping.to(device=device, dtype=torch.int64),
        tables=meta.block_tables.to(device=device, dtype=torch.int32).contiguous(),
        lens=torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_prefill_len=max(new, default=0),
        positions=None if meta.positions is None else meta.positions.to(device=device),
    )


class TritonBackend:
    """Paged attention on GPU tensors (or anywhere under TRITON_INTERPRET=1).

    With `rope` = (cos, sin) [max_positions, head_dim / 2] tables, q and k arrive
    unrotated and the KV write rotates both (`rope_write_kv`: one kernel where RoPE in
    torch took several; measured ~5 points of the 8B step's roofline on the H200)."""

    def __init__(self, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.rope = rope

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = meta.scratch.get(TRITON_PLAN_KEY)
        if plan is None:
            plan = meta.scratch[TRITON_PLAN_KEY] = _plan(meta, q.device)
        if self.rope is not None:
            if plan.positions is None:
                raise ValueError("RoPE in the KV write needs the tokens' positions in the metadata")
            rope_write_kv(q, k, v, kv_cache, plan.slots, plan.positions, *self.rope)
        else:
            write_kv(k, v, kv_cache, plan.slots)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode(q[:nd], kv_cache, plan.tables[:nd], plan.lens[:nd], scale, out=out[:nd])
        if nd < meta.num_seqs:
            paged_prefill(q, kv_cache, plan.tables[nd:], plan.query_start[nd:], plan.lens[nd:], scale,
                          max_query_len=plan.max_prefill_len, out=out)
        return out
