"""Whole blocks out of and into the per-layer KV caches, in the kvstore's block layout.

The engine keeps one tensor per layer, `[2, num_blocks, block_size, kv_heads,
head_dim]`; a block travels as one buffer `[layers, 2, block_size, kv_heads,
head_dim]` (kvstore.layout.KVLayout), the form the kvstore codec frames and
checksums. bf16 has no numpy dtype, so bytes cross as uint8 views.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvyard.kvstore.layout import KVLayout
from kvyard.workers.attention.kv_quant import block_layout, copyable


def layout_of(caches: Sequence[torch.Tensor]) -> KVLayout:
    """The block layout, KV dtype (and a quantized cache's scales) included."""
    return block_layout(caches[0], len(caches))


# Inference mode, not no_grad: after a wake from sleep the caches may be inference tensors,
# which refuse in-place writes outside it (it is per thread, and these run on several).
@torch.inference_mode()
def gather(caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: np.ndarray) -> None:
    """Copy the blocks into `out` (`[len(block_ids), layout.nbytes]` uint8, rows may be
    views into larger frames). Safe off the engine thread for blocks nobody writes
    (held or pinned): the cache tensors are never reallocated. Device caches gather on
    the device, then one copy to the host (on the calling thread's current stream, so
    after the model's writes on the default stream; it returns once `out` is filled)."""
    n = len(block_ids)
    if n == 0:
        return
    caches = [copyable(t) for t in caches]
    t0 = caches[0]
    shape = (n, len(caches), 2, *t0.shape[2:])
    ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=t0.device)
    dst = torch.from_numpy(out).view(t0.dtype).view(shape)
    if t0.device.type == "cpu":
        for layer, kv in enumerate(caches):  # straight into place: no temporary per layer
            torch.index_select(kv, 1, ids, out=dst[:, layer].transpose(0, 1))
        return
    staged = torch.empty(shape, dtype=t0.dtype, device=t0.device)
    for layer, kv in enumerate(caches):
        staged[:, layer].copy_(kv.index_select(1, ids).transpose(0, 1))
    dst.copy_(staged)


@torch.inference_mode()
def scatter(caches: Sequence[torch.Tensor], block_ids: Sequence[int],
            payloads: Sequence[object]) -> None:
    """Write each payload (one block in the travel layout) into its block id."""
    n = len(block_ids)
    if n == 0:
        return
    nbytes = layout_of(caches).nbytes
    caches = [copyable(t) for t in caches]
    t0 = caches[0]
    src = _rows(payloads[:n], nbytes)
    if src is None:
        src = np.empty((n, nbytes), dtype=np.uint8)
        for i, p in enumerate(payloads[:n]):
            src[i] = np.frombuffer(p, dtype=np.uint8, count=nbytes)
    blocks = torch.from_numpy(src).view(t0.dtype).view(n, len(caches), 2, *t0.shape[2:])
    blocks = blocks.to(t0.device)
    ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=t0.device)
    for layer, kv in enumerate(caches):
        kv.index_copy_(1, ids, blocks[:, layer].transpose(0, 1))


def _rows(payloads: Sequence[object], nbytes: int) -> np.ndarray | None:
    """The payloads as one strided `[n, nbytes]` view when they lie evenly spaced in
    one numpy buffer (a peer pull's frames do), so the engine thread copies each block
    once, into the cache, instead of gathering it into a temporary first."""
    first = payloads[0]
    base = getattr(first, "obj", None)
    if not isinstance(base, np.ndarray) or base.ndim != 1 or base.dtype != np.uint8 \
            or not base.flags.writeable:  # torch.from_numpy wants a writable array
        return None
    start = base.ctypes.data
    offs = []
    for p in payloads:
        if not isinstance(p, memoryview) or p.obj is not base or p.nbytes != nbytes:
            return None
        offs.append(np.frombuffer(p, dtype=np.uint8).ctypes.data - start)
    stride = offs[1] - offs[0] if len(offs) > 1 else nbytes
    if stride < nbytes or any(o != offs[0] + i * stride for i, o in enumerate(offs)):
        return None
    end = offs[0] + (len(offs) - 1) * stride + nbytes
    if end > base.nbytes:
        return None
    if len(offs) == 1:
        return base[offs[0]:end].reshape(1, nbytes)
    return np.lib.stride_tricks.as_strided(base[offs[0]:end], shape=(len(offs), nbytes),
                                           strides=(stride, 1))
