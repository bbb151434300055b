"""A GPU address range whose memory can be given back and re-created at the same address.

Why: CUDA graphs replay fixed addresses. Sleep mode frees the weights' and the KV
cache's device memory; if waking re-allocated them through torch's caching
allocator they would land elsewhere and every graph would have to be captured
again (0.7 s for the 8B shape). The driver's virtual memory API separates the
address range (`cuMemAddressReserve`, kept for the buffer's life) from the
physical memory behind it (`cuMemCreate` + `cuMemMap`, released on sleep), so a
wake maps new memory under the old addresses and the graphs stay valid. This is
what vLLM's CuMemAllocator does; here through ctypes on libcuda itself (no extra
package), and torch sees the range as one uint8 tensor (`__cuda_array_interface__`).

The physical memory comes in chunks (`chunk` bytes each), so a buffer can be
filled piecewise (`map(upto)`) while the memory it replaces is freed behind it.
Touching an unmapped range from a kernel is an illegal-address fault: callers
map before any use.
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):          # CUmemAllocationProp (32 bytes)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):         # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class VmmError(RuntimeError):
    pass


_lib_lock = threading.Lock()
_lib: Any = None


def _driver() -> Any:
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            u64, sz, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
            sigs = {
                "cuInit": [ctypes.c_uint],
                "cuCtxGetCurrent": [p(ctypes.c_void_p)],
                "cuCtxSetCurrent": [ctypes.c_void_p],
                "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), ctypes.c_int],
                "cuMemGetAllocationGranularity": [p(sz), p(_AllocProp), ctypes.c_int],
                "cuMemAddressReserve": [p(u64), sz, sz, u64, ctypes.c_ulonglong],
                "cuMemAddressFree": [u64, sz],
                "cuMemCreate": [p(ctypes.c_ulonglong), sz, p(_AllocProp), ctypes.c_ulonglong],
                "cuMemRelease": [ctypes.c_ulonglong],
                "cuMemMap": [u64, sz, sz, ctypes.c_ulonglong, ctypes.c_ulonglong],
                "cuMemUnmap": [u64, sz],
                "cuMemSetAccess": [u64, sz, p(_AccessDesc), sz],
                "cuGetErrorString": [ctypes.c_int, p(ctypes.c_char_p)],
            }
            for name, args in sigs.items():
                f = getattr(lib, name)
                f.argtypes, f.restype = args, ctypes.c_int
            _check(lib, lib.cuInit(0), "cuInit")
            _lib = lib
        return _lib


def _check(lib: Any, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise VmmError(f"{what}: CUDA error {rc} ({(msg.value or b'?').decode()})")


def _ensure_context(lib: Any, device: int) -> None:
    """The driver API needs a current context on this thread (torch's runtime calls make the
    primary one current only on threads that used it)."""
    ctx = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _prop(device: int) -> _AllocProp:
    prop = _AllocProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def _free_range(lib: Any, device: int, ptr: int, size: int, chunks: list[tuple[int, int, int | None]]) -> None:
    """Finalizer: unmap what is mapped, give back the address range (once no tensor views it)."""
    try:
        _ensure_context(lib, device)
        for off, n, h in chunks:
            if h is not None:
                lib.cuMemUnmap(ptr + off, n)
                lib.cuMemRelease(h)
        lib.cuMemAddressFree(ptr, size)
    except Exception:  # noqa: BLE001 - at interpreter exit the driver may already be gone
        pass


class _Exported:
    """What torch.as_tensor wraps: it holds a reference to this for as long as any tensor views
    the range, so the range is freed (finalizer) only after the last view is gone."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}


class VmmBuffer:
    """`nbytes` of device memory at a fixed address; `release()` gives the memory back (the
    contents are lost), `map()` puts new memory under the same addresses."""

    def __init__(self, nbytes: int, device: torch.device, chunk: int = 1 << 30) -> None:
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        lib = self._lib = _driver()
        _ensure_context(lib, self.index)
        gran = ctypes.c_size_t()
        prop = _prop(self.index)
        _check(lib, lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                                      _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity")
        g = max(int(gran.value), 1 << 21)
        self.nbytes = nbytes
        self.size = -(-max(nbytes, 1) // g) * g
        chunk = -(-chunk // g) * g
        ptr = ctypes.c_uint64()
        _check(lib, lib.cuMemAddressReserve(ctypes.byref(ptr), self.size, g, 0, 0), "cuMemAddressReserve")
        self.ptr = int(ptr.value)
        # (offset, bytes, handle or None): the finalizer reads this same list
        self._chunks: list[tuple[int, int, int | None]] = [
            (off, min(chunk, self.size - off), None) for off in range(0, self.size, chunk)]
        self._exported = _Exported(self.ptr, nbytes)
        weakref.finalize(self._exported, _free_range, lib, self.index, self.ptr, self.size, self._chunks)
        self._tensor: torch.Tensor | None = None

    @property
    def mapped(self) -> bool:
        return all(h is not None for _, _, h in self._chunks)

    @property
    def mapped_bytes(self) -> int:
        return sum(n for _, n, h in self._chunks if h is not None)

    def map(self, upto: int | None = None) -> None:
        """Physical memory under [0, upto) (default: all), chunk by chunk."""
        lib, upto = self._lib, self.size if upto is None else upto
        _ensure_context(lib, self.index)
        prop = _prop(self.index)
        access = _AccessDesc()
        access.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.index
        access.flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for i, (off, n, h) in enumerate(self._chunks):
            if off >= upto:
                break
            if h is not None:
                continue
            handle = ctypes.c_ulonglong()
            _check(lib, lib.cuMemCreate(ctypes.byref(handle), n, ctypes.byref(prop), 0), "cuMemCreate")
            rc = lib.cuMemMap(self.ptr + off, n, 0, handle.value, 0)
            if rc == 0:
                rc = lib.cuMemSetAccess(self.ptr + off, n, ctypes.byref(access), 1)
                if rc != 0:
                    lib.cuMemUnmap(self.ptr + off, n)
            if rc != 0:
                lib.cuMemRelease(handle.value)
                _check(lib, rc, "cuMemMap/cuMemSetAccess")
            self._chunks[i] = (off, n, int(handle.value))

    def release(self) -> None:
        """Give the physical memory back; the addresses stay reserved. The caller has synchronized:
        no kernel may still read or write the range."""
        lib = self._lib
        _ensure_context(lib, self.index)
        for i, (off, n, h) in enumerate(self._chunks):
            if h is not None:
                _check(lib, lib.cuMemUnmap(self.ptr + off, n), "cuMemUnmap")
                _check(lib, lib.cuMemRelease(h), "cuMemRelease")
                self._chunks[i] = (off, n, None)

    def tensor(self) -> torch.Tensor:
        """The whole range as one uint8 tensor (its storage does not own the memory)."""
        if self._tensor is None:
            if not self._chunks or self._chunks[0][2] is None:
                self.map(1)
            self._tensor = torch.as_tensor(self._exported, device=self.device)
        return self._tensor


def available() -> bool:
    """Whether the driver's virtual memory API can be used here."""
    try:
        _driver()
        return True
    except (OSError, AttributeError, VmmError):
        return False
