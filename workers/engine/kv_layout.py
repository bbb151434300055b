"""Where a layer's KV cache lies in memory.

Every consumer indexes the cache as [2, blocks, block_size, kv_heads, head_dim] ("NHD") and
follows its strides: the Triton and Gluon kernels take `.stride()` values and need only a
contiguous head_dim, block moves are `index_select` / `index_copy_` along the block axis
(kv_blocks.py, the connector's staging), and the wire format of blocks is NHD whatever the cache
holds. So the physical order is free. "HND" ([2, blocks, kv_heads, block_size, head_dim] in
memory, seen through a permuted view) puts one KV head's rows of a block side by side: for
fp8_e4m3 a decode program then reads 2 KiB runs (16 rows of 128 bytes) instead of 128-byte
rows 1 KiB apart.

`HND_FORMATS` names the KV formats stored HND on CUDA. None is: on an H200 HND made fp8_e4m3
decode 0.5-5% faster (`kvyard.bench.gpu_kvlayout`, docs/gpu-notes.md), too little for an arena
layout only a GPU can exercise.
"""
from __future__ import annotations

from typing import Callable

import torch

HND_FORMATS: frozenset[str] = frozenset()


def uses_hnd(kv_format_name: str | None, device: torch.device) -> bool:
    return device.type == "cuda" and kv_format_name in HND_FORMATS


def physical_shape(shape: tuple[int, ...], hnd: bool) -> tuple[int, ...]:
    """The allocation's shape for logical NHD `shape`."""
    return (shape[0], shape[1], shape[3], shape[2], *shape[4:]) if hnd else tuple(shape)


def logical(t: torch.Tensor, hnd: bool) -> torch.Tensor:
    """The NHD view of an allocation of `physical_shape` (a permutation is its own inverse here)."""
    return t.permute(0, 1, 3, 2, 4) if hnd else t


def allocate(shape: tuple[int, ...], hnd: bool, alloc: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """`alloc(physical shape)`, seen as NHD `shape`."""
    return logical(alloc(physical_shape(shape, hnd)), hnd)
