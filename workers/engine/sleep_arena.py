"""The CUDA weights and KV cache at fixed addresses, so sleep mode can free and restore them
without re-capturing the decode CUDA graphs.

At start (ModelRunner, CUDA) every storage the model's tensors use is copied into one
weight arena and the tensors are re-pointed at it (`Tensor.set_`: the same Python objects,
so modules, LayerWeights and ops state see the move); the KV cache is one arena of
per-layer views. Both are cuda_vmm buffers: their addresses never change, so the graphs
captured afterwards stay valid across any number of sleeps.

- Level 1 (vLLM: weights offloaded to host, KV cache discarded): the weight arena is
  copied to one pinned host buffer (allocated at the first sleep, reused by the next:
  pinning 16 GB costs seconds, a copy into it 0.3 s), then both arenas' memory is
  released. Wake: map both, one host-to-device copy of the weights, zero the KV cache.
- Level 2 (vLLM: both discarded, weights reloaded from the checkpoint): both released and
  the pinned buffer freed; wake maps both and builds the model from its source again
  (fast_reload.py for an HF directory), then copies the fresh tensors into the sleeping
  model's, pairwise in the walk's order (the same build gives the same tensors in the same
  order; any mismatch is an error, not a silent mix).

`pack` is device-agnostic (tests run it on the CPU); the arenas are CUDA-only.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger("kvyard.engine")

ALIGN = 256   # bytes: every storage starts aligned (cuBLAS, Triton vector loads)


def distinct_storages(tensors: list[torch.Tensor], device_type: str) -> list[torch.UntypedStorage]:
    """The storages behind `tensors` on `device_type`, once each, in first-seen order
    (opaque tensors without a storage are left out)."""
    by_ptr: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type == device_type and t.numel():
            try:
                s = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                continue
            if s.nbytes():
                by_ptr.setdefault(s.data_ptr(), s)
    return list(by_ptr.values())


def layout(storages: list[torch.UntypedStorage]) -> tuple[list[int], int]:
    """Each storage's offset in one flat buffer, and the buffer's size."""
    offs, n = [], 0
    for s in storages:
        offs.append(n)
        n += -(-s.nbytes() // ALIGN) * ALIGN
    return offs, n


def pack(tensors: list[torch.Tensor], device_type: str, make: Callable[[int], torch.Tensor],
         ensure: Callable[[int], None] = lambda n: None, on_chunk: Callable[[], None] = lambda: None,
         chunk: int = 1 << 30) -> tuple[torch.Tensor, list[int], list[int]]:
    """Move every storage behind `tensors` into one flat uint8 buffer from `make(nbytes)`.

    Storage by storage: `ensure(end)` makes the buffer usable up to `end` bytes (a lazily
    mapped arena), the bytes are copied, every tensor on that storage is re-pointed at the
    same bytes in the buffer (dtype, shape, strides and offset kept: views and tied weights
    stay views and ties), so the old storage is garbage once nothing else holds it;
    `on_chunk()` runs after each `chunk` bytes (e.g. empty_cache, so the peak stays near the
    model's size plus a chunk). Returns (buffer, offsets, sizes) per storage, in order."""
    storages = distinct_storages(tensors, device_type)
    offs, total = layout(storages)
    buf = make(total)
    users: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t.device.type == device_type and t.numel():
            try:
                users.setdefault(t.untyped_storage().data_ptr(), []).append(t)
            except (NotImplementedError, RuntimeError):
                continue
    dst = buf.untyped_storage()
    sizes, done = [], 0
    for s, off in zip(storages, offs):
        n = s.nbytes()
        ensure(off + n)
        buf[off:off + n].copy_(torch.empty(0, dtype=torch.uint8, device=buf.device).set_(s))
        for t in users.pop(s.data_ptr(), []):
            es = t.element_size()
            t.set_(dst, (off + t.storage_offset() * es) // es, t.size(), t.stride())
        sizes.append(n)
        del s
        if off + n - done >= chunk:
            done = off + n
            on_chunk()
    storages.clear()
    on_chunk()
    return buf, offs, sizes


@dataclass(slots=True)
class SleepArenas:
    """One runner's CUDA weights and KV cache in cuda_vmm buffers, and their sleep state."""

    weights: Any                   # cuda_vmm.VmmBuffer
    weight_offsets: list[int]
    weight_sizes: list[int]
    kv: Any                        # cuda_vmm.VmmBuffer
    kv_caches: list[torch.Tensor]
    host: torch.Tensor | None = None           # pinned copy of the weight arena (level 1)
    host_valid: bool = False
    ring: Any = None                           # fast_reload.PinnedRing (level 2), kept once made
    parts: dict[str, float] = field(default_factory=dict)   # the last sleep's / wake's timed steps

    @classmethod
    def create(cls, model: Any, kv_shape: tuple[int, ...], dtype: torch.dtype, layers: int,
               device: torch.device) -> "SleepArenas | None":
        """Move `model`'s storages into a weight arena and allocate the KV cache in another;
        None where the driver's virtual memory API is unavailable (plain allocations then)."""
        from . import cuda_vmm

        if not cuda_vmm.available():
            return None
        try:
            return cls._create(model, kv_shape, dtype, layers, device)
        except cuda_vmm.VmmError as e:   # the tensors moved so far stay valid where they are
            log.warning("fixed-address arenas unavailable (%s): plain allocations, a wake re-captures "
                        "the CUDA graphs", e)
            return None

    @classmethod
    def _create(cls, model: Any, kv_shape: tuple[int, ...], dtype: torch.dtype, layers: int,
                device: torch.device) -> "SleepArenas":
        from . import cuda_vmm
        from .sleep_mode import _tensors

        with torch.inference_mode():
            holder: dict[str, Any] = {}

            def make(n: int) -> torch.Tensor:
                holder["w"] = cuda_vmm.VmmBuffer(n, device)
                return holder["w"].tensor()

            buf, offs, sizes = pack(_tensors(model), "cuda", make, lambda end: holder["w"].map(end),
                                    torch.cuda.empty_cache)
            del buf
        # The KV cache outside inference mode, as a plain allocation would be: the connector's
        # loads write it in place from threads of their own, where inference mode is off.
        per_layer = 1
        for d in kv_shape:
            per_layer *= d
        es = torch.empty((), dtype=dtype).element_size()
        step = -(-per_layer * es // ALIGN) * ALIGN
        kv = cuda_vmm.VmmBuffer(step * layers, device)
        kv.map()
        flat = kv.tensor()
        caches = [flat[i * step:i * step + per_layer * es].view(dtype).view(kv_shape) for i in range(layers)]
        flat.zero_()
        return cls(holder["w"], offs, sizes, kv, caches)

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    def sleep(self, level: int) -> None:
        """The caller has synchronized the device (no kernel reads either arena any more)."""
        p: dict[str, float] = {}
        t0 = time.perf_counter()
        if level == 1 and self.weights.mapped:
            if self.host is None:
                self.host = torch.empty(self.weights.nbytes, dtype=torch.uint8, pin_memory=True)
                p["pin_host_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            self.host.copy_(self.weights.tensor(), non_blocking=True)
            torch.cuda.synchronize()
            self.host_valid = True
            p["d2h_s"] = time.perf_counter() - t1
        elif level == 2:
            self.host, self.host_valid = None, False   # level 2 keeps no copy of the weights
            if self.ring is None:
                from .fast_reload import PinnedRing

                self.ring = PinnedRing()
                p["pin_ring_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.weights.release()
        self.kv.release()
        p["unmap_s"] = time.perf_counter() - t1
        self.parts = p

    def wake(self, model: Any, reload: Callable[[dict[str, float]], Any]) -> None:
        """Map both arenas back; `model`'s weights from the host copy (level 1) or from
        `reload(parts)`, a freshly built model of the same structure (level 2); the KV cache
        zeroed."""
        p: dict[str, float] = {}
        t0 = time.perf_counter()
        self.weights.map()
        p["map_weights_s"] = time.perf_counter() - t0
        dst = self.weights.tensor()
        if self.host_valid and self.host is not None:
            t1 = time.perf_counter()
            dst.copy_(self.host, non_blocking=True)
            torch.cuda.synchronize()
            p["h2d_s"] = time.perf_counter() - t1
        else:
            t1 = time.perf_counter()
            fresh = reload(p)
            p["load_s"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            self._adopt(model, fresh)
            del fresh
            torch.cuda.empty_cache()
            p["adopt_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        self.kv.map()
        self.kv.tensor().zero_()
        torch.cuda.synchronize()
        p["map_kv_s"] = time.perf_counter() - t1
        self.parts = p

    @staticmethod
    def _adopt(model: Any, fresh: Any) -> None:
        """Copy a freshly built model's tensors into the sleeping one's, pairwise in the walk's
        order (same build, same order; their storages may differ: a reload may hand out views)."""
        from .sleep_mode import _tensors

        mine = [t for t in _tensors(model) if t.device.type == "cuda"]
        new = [t for t in _tensors(fresh) if t.device.type == "cuda"]
        if len(mine) != len(new) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(mine, new)):
            raise RuntimeError(f"reloaded model does not match the sleeping one ({len(new)} vs {len(mine)} "
                               "tensors, or their shapes)")
        for a, b in zip(mine, new):
            a.copy_(b)
        torch.cuda.synchronize()
