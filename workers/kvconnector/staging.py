"""KV caches on a CUDA device: staged through pinned (page-locked) host memory, so
each host<->device transfer is a DMA at bus speed instead of the driver's
bounce copy through its own pinned buffer.

- `save` gathers on the GPU (per layer, `index_select` copied into a device
  tensor laid out as frames: header room + payload; the header bytes travel
  as garbage the store overwrites), then one `non_blocking` D2H copy per run
  of frames into pinned memory, one stream sync, then `put`.
- Frames come from a `PinnedArena` (workers/pinned_arena.py): pinned slabs
  filled by a bump pointer, so consecutive saves share a slab and a save is
  one copy per slab it spans; a slab is reused only once no view of its
  frames is left (the DRAM tier, the writer queue and readers keep them), so
  the store never sees memory overwritten while it holds it. The pinned
  footprint is about what the store holds at once (the DRAM tier plus one
  save's frames), so `--kv-dram-gb` bounds it and there is no separate cap.
  If pinning fails, the arena falls back to pageable slabs
  (`pinned_fallbacks` counts them).
- `load`: DRAM hits whose frames lie in this connector's arena (its own saves:
  the common case) are copied to the GPU where they lie, one `non_blocking`
  H2D per run of adjacent frames, then `index_copy_` per layer: no host copy
  at all. Other blocks have the store fill one of two pinned staging buffers
  (reused), one H2D copy, `index_copy_` per layer; the store fills the other
  buffer while that copy runs (an event guards reuse). A stream sync ends the
  call, so the blocks are in the cache on return, and the DRAM views are held
  until then, whatever the tier evicts meanwhile.
- `pin_memory=False` runs these paths through pageable slabs and buffers, the
  benchmark's baseline (`kvyard bench connector`; numbers in docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.workers.pinned_arena import SLAB_BYTES, PinnedArena

# Pinned slabs and load buffers of this size (a power of two); one D2H/H2D copy
# moves at most this much.
_SLAB_BYTES = SLAB_BYTES
# DRAM hits copied to the GPU in place: at most this much per device buffer
_DIRECT_BYTES = 4 * SLAB_BYTES
# a CUDA save gathers at most this much of frames on the device at once
_GATHER_BYTES = 16 * SLAB_BYTES


class StagedPaths:
    """StoreConnector's device paths (a mixin: the state is the connector's)."""

    # tests set this to run the staged (device) path with CPU caches
    _force_staging = False

    def _init_staging(self) -> None:
        if self._arena is None:
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
        host copy: a memcpy into a staging buffer would bound DRAM loads by host
        memcpy bandwidth, far below the DMA's (measured: see docs/benchmarks.md,
        connector). Returns how many."""
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
        layer), not one arena run at a time: per run, a large save of small blocks
        makes hundreds of small device ops and is bound by their launches
        (measured: see docs/benchmarks.md, connector)."""
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
