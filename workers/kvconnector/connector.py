"""The engine's KVConnector over a tiered kvstore.KVStore.

The engine keeps one tensor per layer, `[2, num_blocks, block_size, kv_heads,
head_dim]`; the store keeps one contiguous buffer per block holding that
block's K and V for every layer, `[layers, 2, block_size, kv_heads,
head_dim]` (see kvstore.codec). `save` gathers with one `index_select` per
layer and chunk, written straight into *framed* buffers (header room +
payload, no temporary) whose ownership passes to the store, so no further
copy is made on the way to DRAM, SSD or Redis; `load` has the store fill a
staging buffer (`get_into`: SSD reads land there directly) and scatters with
one `index_copy_` per layer. bf16 has no numpy dtype, so bytes cross as
uint8 views of the tensor.

The store is created at `bind`, when the cache's dtype and shape are known:
the layout (and so the key namespace) is read from the tensors themselves,
never assumed. Caches on a CUDA device take the paths in `staging.py`.

`load` runs on the engine's KV loader thread (engine/kv_loads.py), beside
`save` on the engine thread: the store is thread-safe, and a load writes only
blocks its request owns, which nothing reads until the engine collects it.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import torch

from kvyard.kvstore import KVLayout, KVStore, Namespace, StoreConfig
from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.kvstore.malloc import CHUNK_BYTES
from kvyard.kvstore.metrics import KVStoreCollector

from kvyard.workers.attention.kv_quant import block_layout, copyable
from kvyard.workers.pinned_arena import PinnedArena

from .staging import StagedPaths

# Frames are allocated in chunks below glibc's mmap threshold (CHUNK_BYTES, see
# kvstore/malloc.py), so they come from the heap and reuse the warm memory of
# evicted or sent blocks instead of faulting in a fresh mmap per save. numpy
# allocates them (not torch.empty): it asks for transparent huge pages on
# buffers >= 4 MiB, fewer TLB misses when the tier later copies blocks out.
_CHUNK_BYTES = CHUNK_BYTES


class StoreConnector(StagedPaths):
    """A `KVConnector` (workers/engine/api.py) backed by a tiered KVStore."""

    def __init__(self, config: StoreConfig, model_identity: str,
                 layout: KVLayout | None = None, store: KVStore | None = None,
                 pin_memory: bool = True, direct_loads: bool = True) -> None:
        """`store`: an existing store to share (e.g. one DRAM tier for several engines in
        one process); its namespace must match what `bind` finds. `pin_memory`: stage
        CUDA caches through pinned host memory (False: pageable, the benchmark's baseline).
        `direct_loads`: copy DRAM hits from this connector's own pinned frames to the
        device in place (False: through the staging buffers, as other hits)."""
        self.config = config
        self.pin_memory = pin_memory
        self.direct_loads = direct_loads
        self._staged = False
        self._device: torch.device | None = None
        self._arena: PinnedArena | None = None
        self._load_host: list[tuple[torch.Tensor, np.ndarray]] = []
        self._load_events: list[Any] = [None, None]
        self._load_lock = threading.Lock()
        self._shared = store
        self.model_identity = model_identity
        self.expected_layout = layout
        self.layout: KVLayout | None = None
        self.store: KVStore | None = None
        self._caches: list[torch.Tensor] = []
        self.loaded_blocks = 0
        self.direct_blocks = 0  # of loaded_blocks: copied to the device from the DRAM tier in place
        self.saved_blocks = 0

    def bind(self, kv_caches: Sequence[Any], block_size: int) -> None:
        caches = list(kv_caches)
        if not caches:
            raise ValueError("no KV cache tensors to bind")
        t0 = caches[0]
        if t0.dim() != 5 or t0.shape[0] != 2 or t0.shape[2] != block_size:
            raise ValueError(f"KV cache must be [2, blocks, {block_size}, heads, dim], "
                             f"got {tuple(t0.shape)}")
        if any(t.shape != t0.shape or t.dtype != t0.dtype or t.stride() != t0.stride() or t.stride(-1) != 1
               for t in caches):   # any physical order (engine/kv_layout.py): blocks move by index_select
            raise ValueError("all layers' KV caches must share shape, dtype and strides, head_dim contiguous")
        layout = block_layout(t0, len(caches))
        if self.expected_layout is not None and self.expected_layout != layout:
            raise ValueError(f"KV cache layout {layout} differs from configured "
                             f"{self.expected_layout}")
        ns = Namespace(self.model_identity, layout)
        if self._shared is not None:
            if self._shared.namespace != ns:
                raise ValueError(f"shared store holds {self._shared.namespace}, cache is {ns}")
            store = self._shared
        else:
            if self.store is not None:
                self.store.close()
            store = KVStore.from_config(ns, self.config)
        self.layout = layout
        self._caches = [copyable(t) for t in caches]  # blocks move as elements, fp8 as bytes
        self.store = store
        self._device = t0.device
        self._staged = t0.device.type != "cpu" or self._force_staging
        if self._staged:
            self._init_staging()

    def lookup(self, block_hashes: Sequence[int]) -> int:
        if self.store is None or not block_hashes:
            return 0
        return self.store.lookup(block_hashes)[0]

    @torch.inference_mode()  # the caches may be inference tensors (sleep_arena's CUDA KV arena)
    def load(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        """Copy the leading blocks the store returns; stop at the first one it cannot."""
        if self.store is None or not block_hashes:
            return 0
        lay = self.layout
        want = min(len(block_hashes), len(block_ids))
        if self._staged:
            return self._load_staged(list(block_hashes)[:want], block_ids, want)
        staged = np.empty((want, lay.nbytes), dtype=np.uint8)
        n = self.store.get_into(list(block_hashes)[:want], list(staged))
        if n == 0:
            return 0
        src = torch.from_numpy(staged[:n]).view(self._caches[0].dtype).view(n, *lay.shape)
        ids = torch.as_tensor(list(block_ids[:n]), dtype=torch.long)
        for layer, kv in enumerate(self._caches):
            kv.index_copy_(1, ids, src[:, layer].transpose(0, 1))
        self.loaded_blocks += n
        return n

    @torch.no_grad()
    def save(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> None:
        """Gather the blocks and hand them to the store; never waits for SSD or Redis."""
        if self.store is None or not block_hashes:
            return
        dram = self.store.dram
        pairs = [(h, b) for h, b in zip(block_hashes, block_ids)
                 if dram is None or not dram.contains(self.store.namespace.key(h))]
        if not pairs:
            return
        if self._staged:
            self._save_staged(pairs)
            return
        lay = self.layout
        frame = HEADER_BYTES + lay.nbytes
        per = max(1, _CHUNK_BYTES // frame)
        ids = torch.as_tensor([b for _, b in pairs], dtype=torch.long)
        rows: list[np.ndarray] = []
        for s in range(0, len(pairs), per):
            part = ids[s:s + per]
            m = len(part)
            # framed rows: header room, then the payload, so the store sends each row as is
            arr = np.empty((m, frame), dtype=np.uint8)
            frames = torch.from_numpy(arr)
            blocks = frames[:, HEADER_BYTES:].view(self._caches[0].dtype).view(m, *lay.shape)
            for layer, kv in enumerate(self._caches):  # straight into place, no temporary
                torch.index_select(kv, 1, part, out=blocks[:, layer].transpose(0, 1))
            rows.extend(arr[i] for i in range(m))
        self.store.put([h for h, _ in pairs], rows)
        self.saved_blocks += len(pairs)

    def collector(self) -> KVStoreCollector:
        """Prometheus collector for the worker's registry (valid before bind)."""
        return KVStoreCollector(lambda: self.store)

    def close(self) -> None:
        if self.store is not None and self.store is not self._shared:
            self.store.close()
