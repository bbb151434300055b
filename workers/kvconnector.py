"""The bridge between the engine's KV-cache tensors and kvyard.kvstore.

The engine keeps one tensor per layer, `[2, num_blocks, block_size, kv_heads,
head_dim]`; the store keeps one contiguous buffer per block holding that
block's K and V for every layer, `[layers, 2, block_size, kv_heads,
head_dim]` (see kvstore.codec). `save` gathers with one `index_select` per
layer and chunk, written straight into *framed* buffers (header room +
payload; no temporary: 2x the throughput of index_select + copy_) whose
ownership passes to the store, so no further copy is made on the way to DRAM, SSD or
Redis; `load` has the store fill a staging buffer (`get_into`: SSD reads land
there directly) and scatters with one `index_copy_` per layer. bf16 has no numpy dtype, so bytes cross as uint8 views of the tensor.

The store is created at `bind`, when the cache's dtype and shape are known:
the layout (and so the key namespace) is read from the tensors themselves,
never assumed.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

import numpy as np
import torch

from kvyard.kvstore import KVLayout, KVStore, Namespace, StoreConfig
from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.kvstore.malloc import CHUNK_BYTES
from kvyard.kvstore.metrics import KVStoreCollector

_GB = 10**9
# Frames are allocated in chunks below glibc's mmap threshold (CHUNK_BYTES, see
# kvstore/malloc.py), so they come from the heap and reuse the warm memory of
# evicted or sent blocks; one tensor for a whole save (262 MB for 125 8B-class
# blocks) was a fresh mmap every time, its pages faulted and zeroed during the
# gather: 1.6 GB/s against 4.6 warm. numpy allocates them (not torch.empty): it
# asks for transparent huge pages on buffers >= 4 MiB, fewer TLB misses when
# the tier later copies blocks out.
_CHUNK_BYTES = CHUNK_BYTES


class StoreConnector:
    """A `KVConnector` (workers/engine/api.py) backed by a tiered KVStore."""

    def __init__(self, config: StoreConfig, model_identity: str,
                 layout: KVLayout | None = None, store: KVStore | None = None) -> None:
        """`store`: an existing store to share (e.g. one DRAM tier for several engines in
        one process); its namespace must match what `bind` finds."""
        self.config = config
        self._shared = store
        self.model_identity = model_identity
        self.expected_layout = layout
        self.layout: KVLayout | None = None
        self.store: KVStore | None = None
        self._caches: list[torch.Tensor] = []
        self.loaded_blocks = 0
        self.saved_blocks = 0

    def bind(self, kv_caches: Sequence[Any], block_size: int) -> None:
        caches = list(kv_caches)
        if not caches:
            raise ValueError("no KV cache tensors to bind")
        t0 = caches[0]
        if t0.dim() != 5 or t0.shape[0] != 2 or t0.shape[2] != block_size:
            raise ValueError(f"KV cache must be [2, blocks, {block_size}, heads, dim], "
                             f"got {tuple(t0.shape)}")
        if any(t.shape != t0.shape or t.dtype != t0.dtype or not t.is_contiguous()
               for t in caches):
            raise ValueError("all layers' KV caches must share shape and dtype, contiguous")
        layout = KVLayout(str(t0.dtype).removeprefix("torch."), block_size, len(caches),
                          int(t0.shape[3]), int(t0.shape[4]))
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
        self._caches = caches
        self.store = store

    def lookup(self, block_hashes: Sequence[int]) -> int:
        if self.store is None or not block_hashes:
            return 0
        return self.store.lookup(block_hashes)[0]

    @torch.no_grad()
    def load(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        """Copy the leading blocks the store returns; stop at the first one it cannot."""
        if self.store is None or not block_hashes:
            return 0
        lay = self.layout
        want = min(len(block_hashes), len(block_ids))
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


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("kvstore (external KV-block cache; off unless a tier is set)")
    g.add_argument("--kv-dram-gb", type=float, default=0.0,
                   help="in-process DRAM tier capacity, GB (10^9 bytes)")
    g.add_argument("--kv-ssd-dir", default=None,
                   help="SSD tier directory (may be shared by workers on one node)")
    g.add_argument("--kv-ssd-gb", type=float, default=0.0, help="SSD tier capacity, GB")
    g.add_argument("--kv-ssd-fsync", action="store_true",
                   help="fsync every block file (durable across power loss; slower)")
    g.add_argument("--kv-redis-url", default=None,
                   help="redis://[:password@]host:port/db, or redis+cluster://host:port")
    g.add_argument("--kv-redis-password", default=None,
                   help="Redis password when not in the URL (default $KVYARD_REDIS_PASSWORD)")
    g.add_argument("--kv-redis-prefix", default="kvyard:kv:", help="key prefix in Redis")
    g.add_argument("--kv-redis-ttl", type=int, default=None, help="seconds a block lives in Redis")
    g.add_argument("--kv-redis-cluster", action="store_true",
                   help="use Redis Cluster (also implied by a redis+cluster:// URL)")
    g.add_argument("--kv-queue-blocks", type=int, default=1024,
                   help="writer queue bound; writes beyond it are dropped, never waited for")


def store_config(args: argparse.Namespace) -> StoreConfig:
    ssd_dir = getattr(args, "kv_ssd_dir", None)
    ssd_gb = getattr(args, "kv_ssd_gb", 0.0) or 0.0
    if ssd_dir and ssd_gb <= 0:
        raise ValueError("--kv-ssd-dir needs --kv-ssd-gb (the tier's capacity)")
    return StoreConfig(
        dram_bytes=int((getattr(args, "kv_dram_gb", 0.0) or 0.0) * _GB),
        ssd_dir=ssd_dir, ssd_bytes=int(ssd_gb * _GB),
        ssd_fsync=bool(getattr(args, "kv_ssd_fsync", False)),
        redis_url=getattr(args, "kv_redis_url", None),
        redis_password=getattr(args, "kv_redis_password", None)
        or os.environ.get("KVYARD_REDIS_PASSWORD") or None,
        redis_prefix=getattr(args, "kv_redis_prefix", "kvyard:kv:"),
        redis_ttl_s=getattr(args, "kv_redis_ttl", None),
        redis_cluster=bool(getattr(args, "kv_redis_cluster", False)),
        queue_blocks=getattr(args, "kv_queue_blocks", 1024))


def model_identity_of(model_ref: str) -> str:
    """'<model name>@<weights fingerprint>': what the namespace digest is made of."""
    from kvyard.common.models import fingerprint, resolve_model

    src = resolve_model(model_ref)
    return f"{src.served_name}@{fingerprint(src)}"


def build_connector(args: argparse.Namespace, model: Any,
                    layout: KVLayout | None = None) -> StoreConnector | None:
    """A connector, or None when no tier is configured.

    `model` is the model identity string, or the EngineConfig (the worker's
    server passes that), from whose `model` the identity is derived.
    """
    cfg = store_config(args)
    if not cfg.any_tier:
        return None
    identity = model if isinstance(model, str) else model_identity_of(model.model)
    return StoreConnector(cfg, identity, layout)
