"""The attention backend boundary: the only place that knows how K/V are paged.

The engine builds an `AttentionMetadata` per step; the model passes it to the
backend in every layer. The CPU backend (torch_cpu.py) and the Triton one
(triton_backend.py) implement the same `AttentionBackend`; the Triton one can
also apply RoPE to q and k inside its KV write (the model then hands it q/k
unrotated; `positions` says where the tokens sit).

KV cache layout, per layer: one tensor `[2, num_blocks, block_size,
num_kv_heads, head_dim]` (index 0 = K, 1 = V) in the model's dtype. A token's
slot is `block_id * block_size + offset`.

Batch layout of a step: the first `num_decodes` sequences are decodes (one
new token each), the rest are prefill chunks (one or more new tokens, which
may start after cached or earlier-chunk tokens). Tokens are flattened in that
order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64: where each new token's K/V go
    query_start_loc: list[int]       # [B+1] cumulative new-token counts (cu_seqlens_q)
    seq_lens: list[int]              # [B] context length after this step (cached + new)
    block_tables: torch.Tensor       # [B, max_blocks] int64 block ids, padded with 0
    num_decodes: int                 # sequences [0, num_decodes) are single-token decodes
    scratch: dict[str, Any] = field(default_factory=dict)  # backend caches per-step derived tensors here
    positions: torch.Tensor | None = None  # [T] the new tokens' positions, for backends that apply RoPE

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,             # [T, num_heads, head_dim]
        k: torch.Tensor,             # [T, num_kv_heads, head_dim]
        v: torch.Tensor,             # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,      # this layer's cache, layout above
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...           # [T, num_heads, head_dim]
