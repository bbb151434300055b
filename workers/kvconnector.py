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

KV caches on a CUDA device are staged through pinned (page-locked) host
memory, so each host<->device transfer is a DMA at bus speed instead of the
driver's bounce copy through its own pinned buffer:
- `save` gathers on the GPU (per layer, `index_select` copied into a device
  tensor laid out as frames: header room + payload; the header bytes travel
  as garbage the store overwrites), then one `non_blocking` D2H copy per run
  of frames into pinned memory, one stream sync, then `put`.
- Frames come from a `PinnedArena` (workers/pinned_arena.py): 32 MiB pinned
  slabs filled by a bump pointer, so consecutive saves share a slab and a save
  is one copy per slab it spans; a slab is reused only once no view of its
  frames is left (the DRAM tier, the writer queue and readers keep them), so
  the store never sees memory overwritten while it holds it. Pinned
  footprint: the most the store ever held at once, i.e. the DRAM tier's
  contents (+4-7% in slab tails, measured) plus one save's frames (and
  frames queued for SSD/Redis): 1.31-1.38 GB for a full 1 GB tier taking
  256 MB saves. Decision: no separate pinned cap; `--kv-dram-gb` bounds it.
  If pinning fails (the OS refused), the arena falls back to pageable slabs
  (`pinned_fallbacks` counts them).
- `load`: DRAM hits whose frames lie in this connector's arena (its own
  saves: the common case, a prefix this worker computed before) are copied
  to the GPU where they lie, one `non_blocking` H2D per run of adjacent
  frames into one device buffer, then `index_copy_` per layer: no host copy
  at all. Other blocks (SSD, Redis, DRAM copies promoted from those, blocks
  of another connector sharing the store) have the store fill one of two
  pinned staging buffers (32 MiB each, reused), one H2D copy, `index_copy_`
  per layer; the store fills the other buffer while that copy runs (an
  event guards reuse). A stream sync ends the call, so the blocks are in
  the cache on return, and the DRAM views are held until then, whatever the
  tier evicts meanwhile.
- Measured (`kvyard bench connector`, H200, bf16, 256 MB per call, DRAM hits,
  2026-11-30, two runs): load in place 31.7-36.7 / 43.0-43.8 GB/s (demo /
  8B-class blocks) against 4.1-4.5 / 4.5-4.7 through pinned staging and
  2.4-2.9 through pageable: the staging copy, a host memcpy at 8-10 GB/s
  there, was the bound. Raw pinned H2D of the same bytes in one piece:
  55 GB/s. Save 27.3 / 37.3 GB/s pinned vs 9.3 / 10.1 pageable (0.49 / 0.68
  of a raw D2H), up from 23.6 / 24.5 when the gather ran per arena run
  (profiled: 11 ms of launch-bound small ops per 256 MB); what is left of a
  demo-block save is mostly per-block Python (the DRAM filter and `put`,
  about 3 ms for 694 blocks).
- CPU caches keep the path above (numpy frames, no staging copy);
  `pin_memory=False` runs the staged path through pageable slabs and
  buffers, the benchmark's baseline.
"""
from __future__ import annotations

import argparse
import threading
from typing import Any, Sequence

import numpy as np
import torch

from kvyard.kvstore import KVLayout, KVStore, Namespace, StoreConfig
from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.kvstore.flags import add_kv_arguments, store_config
from kvyard.kvstore.malloc import CHUNK_BYTES
from kvyard.kvstore.metrics import KVStoreCollector
from kvyard.workers.pinned_arena import SLAB_BYTES, PinnedArena

__all__ = ["PinnedArena", "StoreConnector", "add_kv_arguments", "build_connector", "store_config"]

# Frames are allocated in chunks below glibc's mmap threshold (CHUNK_BYTES, see
# kvstore/malloc.py), so they come from the heap and reuse the warm memory of
# evicted or sent blocks; one tensor for a whole save (262 MB for 125 8B-class
# blocks) was a fresh mmap every time, its pages faulted and zeroed during the
# gather: 1.6 GB/s against 4.6 warm. numpy allocates them (not torch.empty): it
# asks for transparent huge pages on buffers >= 4 MiB, fewer TLB misses when
# the tier later copies blocks out.
_CHUNK_BYTES = CHUNK_BYTES
# Staging for CUDA caches: pinned slabs and load buffers of this size (a power of
# two, see the module docstring); one D2H/H2D copy moves at most this much.
_SLAB_BYTES = SLAB_BYTES
# DRAM hits copied to the GPU in place: at most this much per device buffer
_DIRECT_BYTES = 4 * SLAB_BYTES
# a CUDA save gathers at most this much of frames on the device at once
_GATHER_BYTES = 16 * SLAB_BYTES


class StoreConnector:
    """A `KVConnector` (workers/engine/api.py) backed by a tiered KVStore."""

    # tests set this to run the staged (device) path with CPU caches
    _force_staging = False

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
        self._device = t0.device
        self._staged = t0.device.type != "cpu" or self._force_staging
        if self._staged and self._arena is None:
            pin = self.pin_memory and torch.cuda.is_available()
            self._arena = PinnedArena(_SLAB_BYTES, pin=pin)
            self._load_host = [self._stage_buffer(pin) for _ in range(2)]

    @staticmethod
    def _stage_buffer(pin: bool) -> tuple[torch.Tensor, np.ndarray]:
        t = torch.empty(_SLAB_BYTES, dtype=torch.uint8, pin_memory=pin)
        return t, t.numpy()

    def _sync(self) -> None:
        """Wait for this thread's work on the caches' device (the current stream)."""
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

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

    def _load_staged(self, hashes: list[int], block_ids: Sequence[int], want: int) -> int:
        """Device caches. DRAM hits whose frames lie in this connector's pinned arena
        (its own saves) go to the GPU from where they lie (`_load_direct`). Other
        blocks: store -> pinned buffer -> one H2D copy -> index_copy_ per layer,
        32 MiB at a time, the store filling one buffer while the other is copied."""
        lay = self.layout
        nb = lay.nbytes
        dtype = self._caches[0].dtype
        dev = self._device
        cuda = dev.type == "cuda"
        per = max(1, _SLAB_BYTES // nb)
        per_direct = max(1, _DIRECT_BYTES // (HEADER_BYTES + nb))
        ids = torch.as_tensor(list(block_ids[:want]), dtype=torch.long).to(dev)
        keep: list[list[memoryview]] = []  # views under in-flight copies: alive until the sync
        n = k = 0
        with self._load_lock:  # the staging buffers are this connector's, one load at a time
            while n < want:
                got = self._load_direct(hashes[n:n + min(per_direct, want - n)], ids[n:], keep)
                if got:
                    n += got
                    continue
                m = self._staged_run(hashes, n, min(per, want - n))
                host, arr = self._load_host[k]
                ev = self._load_events[k]
                if ev is not None:
                    ev.synchronize()  # its H2D copy from two rounds ago is done
                got = self.store.get_into(hashes[n:n + m], list(arr[:m * nb].reshape(m, nb)))
                if got == 0:
                    break
                staged = torch.empty((got, nb), dtype=torch.uint8, device=dev)
                staged.copy_(host[:got * nb].view(got, nb), non_blocking=True)
                if cuda:
                    ev = self._load_events[k] = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(dev))
                src = staged.view(dtype).view(got, *lay.shape)
                part = ids[n:n + got]
                for layer, kv in enumerate(self._caches):
                    kv.index_copy_(1, part, src[:, layer].transpose(0, 1))
                n += got
                k ^= 1
                if got < m:
                    break
            self._sync()
        self.loaded_blocks += n
        self.direct_blocks += sum(len(v) for v in keep)
        return n

    def _direct_ok(self) -> bool:
        a = self._arena
        return self.direct_loads and a is not None and (a.pin or self._force_staging)

    def _staged_run(self, hashes: list[int], n: int, m: int) -> int:
        """How many blocks from n the staged path takes: up to m, ending before the next
        block DRAM holds, which the next round tries to copy in place."""
        dram = self.store.dram
        if dram is None or not self._direct_ok():
            return m
        for j, key in enumerate(self.store.namespace.keys(hashes[n + 1:n + m]), 1):
            if dram.contains(key):
                return j
        return m

    def _load_direct(self, hashes: list[int], ids: torch.Tensor, keep: list) -> int:
        """The leading DRAM hits whose frames sit in a pinned slab of the arena: one
        non_blocking H2D copy per run of adjacent frames (a save's frames lie
        back to back) into one device buffer, then index_copy_ per layer. No
        host copy: measured on an H200, a host memcpy into the staging buffer
        held DRAM loads to about half of a memcpy's rate. Returns how many."""
        arena = self._arena
        if not self._direct_ok():
            return 0
        lay = self.layout
        frame = HEADER_BYTES + lay.nbytes
        locs: list[tuple[torch.Tensor, int]] = []

        def pinned(mv: memoryview) -> bool:
            addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data - HEADER_BYTES
            loc = arena.locate(addr, frame)
            if loc is None or not (loc[2] or self._force_staging):  # pageable: the staged path
                return False
            locs.append(loc[:2])
            return True
        views = self.store.dram_views(hashes, pinned)
        r = len(views)
        if not r:
            return 0
        keep.append(views)
        staged = torch.empty((r, frame), dtype=torch.uint8, device=self._device)
        i = 0
        while i < r:
            slab, off = locs[i]
            j = i + 1
            while j < r and locs[j][0] is slab and locs[j][1] == off + (j - i) * frame:
                j += 1
            staged[i:j].copy_(slab[off:off + (j - i) * frame].view(j - i, frame), non_blocking=True)
            i = j
        src = staged[:, HEADER_BYTES:].view(self._caches[0].dtype).view(r, *lay.shape)
        part = ids[:r]
        for layer, kv in enumerate(self._caches):
            kv.index_copy_(1, part, src[:, layer].transpose(0, 1))
        return r

    def _save_staged(self, pairs: list[tuple[int, int]]) -> None:
        """Device caches: gather on the device into frames, one D2H copy per run of
        frames into the arena, one sync, then the store owns the frames.

        The gather covers up to `_GATHER_BYTES` of frames at once (two ops per
        layer), not one arena run at a time: per run, a 256 MB save of demo
        blocks made 480 small ops, launch-bound at 11 ms on an H200 (23 GB/s)."""
        lay = self.layout
        frame = HEADER_BYTES + lay.nbytes
        dtype = self._caches[0].dtype
        dev = self._device
        ids = torch.as_tensor([b for _, b in pairs], dtype=torch.long).to(dev)
        per = max(1, _GATHER_BYTES // frame)
        rows: list[np.ndarray] = []
        for g in range(0, len(pairs), per):
            part = ids[g:g + per]
            total = part.numel()
            staged = torch.empty((total, frame), dtype=torch.uint8, device=dev)
            blocks = staged[:, HEADER_BYTES:].view(dtype).view(total, *lay.shape)
            for layer, kv in enumerate(self._caches):
                blocks[:, layer].copy_(kv.index_select(1, part).transpose(0, 1))
            s = 0
            while s < total:
                host, arr = self._arena.carve(frame, total - s)
                m = arr.shape[0]
                host.view(m, frame).copy_(staged[s:s + m], non_blocking=True)
                rows.extend(arr)
                s += m
        self._sync()  # the frames are complete before the store (or its threads) sees them
        self.store.put([h for h, _ in pairs], rows)
        self.saved_blocks += len(pairs)

    def collector(self) -> KVStoreCollector:
        """Prometheus collector for the worker's registry (valid before bind)."""
        return KVStoreCollector(lambda: self.store)

    def close(self) -> None:
        if self.store is not None and self.store is not self._shared:
            self.store.close()


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
