"""Level-2 wake's reload of an HF directory, at page-cache and PCIe speed.

The loader's own path reads each tensor through safetensors' mmap (page faults on one
thread) and copies it from pageable memory (measured on the H200 host: 7 GB/s pageable
against 55 GB/s pinned; 8 threads read the page cache at 34 GB/s), 3.1 s for the 8B
shape. Here the files' data sections are streamed whole into one device staging buffer:
`threads` readers, each with its own pinned slot (kept in a `PinnedRing` for the
engine's life: pinning ran at 1.7-2.3 GB/s there, so a per-wake buffer would cost more
than the reload), `preadv` a piece from the page cache, copy it to the device on the reader's
own stream and wait for that copy before reusing the slot. Then the loader's `build`
runs over views of the staging buffer (its casts and fusions as always), so the result
is the model `load_model` gives, from the checkpoint's bytes, not from any copy of the
weights kept while asleep (vLLM's level 2 keeps none).

Peak device memory during the reload: the staging buffer (the files' size) plus what
`build` allocates (fused matrices), beside the weight arena being refilled.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def shard_files(d: Path) -> list[Path]:
    """The shards the loader reads (the index's, else every *.safetensors), in its order."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        return [d / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(d.glob("*.safetensors"))


def read_header(path: Path) -> tuple[int, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """(where the data section starts, name -> (dtype, shape, begin, end) within it)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {e['dtype']}")
        out[name] = (_DTYPES[e["dtype"]], list(e["shape"]), *e["data_offsets"])
    return 8 + n, out


class PinnedRing:
    """One pinned host slot per reader thread, allocated once and reused by every reload."""

    def __init__(self, threads: int = 8, slot: int = 64 << 20) -> None:
        pin = torch.cuda.is_available()
        self.slot = slot
        self.slots = [torch.empty(slot, dtype=torch.uint8, pin_memory=pin) for _ in range(threads)]

    @property
    def threads(self) -> int:
        return len(self.slots)


def stream_files(files: list[Path], device: torch.device, ring: PinnedRing) -> tuple[torch.Tensor, list[int]]:
    """The data sections of `files`, back to back, in one uint8 tensor on `device`, and each
    file's base offset in it."""
    heads = [read_header(f)[0] for f in files]
    sizes = [f.stat().st_size - h for f, h in zip(files, heads)]
    bases, n = [], 0
    for k in sizes:                  # each file's region 256-byte aligned (its tensors are views)
        bases.append(n)
        n += -(-k // 256) * 256
    staging = torch.empty(n, dtype=torch.uint8, device=device)
    jobs = [(f, h + a, min(ring.slot, n - a), base + a)
            for f, h, n, base in zip(files, heads, sizes, bases) for a in range(0, n, ring.slot)]
    nxt = iter(jobs)
    lock = threading.Lock()
    cuda = device.type == "cuda"
    fds = {f: os.open(f, os.O_RDONLY) for f in files}

    inference = torch.is_inference_mode_enabled()   # thread-local: the readers take the caller's

    def reader(i: int) -> int:
        with torch.inference_mode(inference):
            return read_pieces(i)

    def read_pieces(i: int) -> int:
        slot = ring.slots[i]
        view = memoryview(slot.numpy())
        stream = torch.cuda.Stream(device) if cuda else None
        done = 0
        while True:
            with lock:
                job = next(nxt, None)
            if job is None:
                return done
            f, off, k, dst = job
            got = os.preadv(fds[f], [view[:k]], off)
            if got != k:
                raise OSError(f"{f.name}: short read at {off} ({got} of {k} bytes)")
            if stream is not None:
                with torch.cuda.stream(stream):
                    staging[dst:dst + k].copy_(slot[:k], non_blocking=True)
                stream.synchronize()      # the slot is refilled next
            else:
                staging[dst:dst + k].copy_(slot[:k])
            done += k

    try:
        with ThreadPoolExecutor(ring.threads) as ex:
            total = sum(ex.map(reader, range(ring.threads)))
    finally:
        for fd in fds.values():
            os.close(fd)
    if total != sum(sizes):
        raise OSError(f"read {total} of {sum(sizes)} bytes")
    return staging, bases


@dataclass(slots=True)
class StagedSource:
    """The loader's WeightSource over views of the staging buffer."""

    staging: torch.Tensor
    where: dict[str, tuple[torch.dtype, list[int], int, int]]   # absolute begin/end in staging
    nbytes: int

    @classmethod
    def from_files(cls, files: list[Path], device: torch.device, ring: PinnedRing) -> "StagedSource":
        staging, bases = stream_files(files, device, ring)
        where = {}
        for f, base in zip(files, bases):
            for name, (dt, shape, a, b) in read_header(f)[1].items():
                where[name] = (dt, shape, base + a, base + b)
        return cls(staging, where, staging.numel())

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        dt, shape, a, b = self.where[name]
        raw = self.staging[a:b]
        es = torch.empty((), dtype=dt).element_size()
        if a % es:                 # safetensors packs tensors back to back: realign by a copy
            raw = raw.clone()
        return raw.view(dt).view(shape)

    def get_int4(self, name: str) -> None:
        return None

    def get_quant(self, name: str) -> None:
        return None


def reload_hf(directory: str | Path, dtype: torch.dtype, max_len: int | None, device: torch.device,
              ring: PinnedRing, parts: dict[str, float] | None = None) -> Any:
    """The model `load_model` builds from this HF directory, read as described above
    (`parts` gets the read and build times)."""
    from kvyard.workers.model.config import config_from_hf
    from kvyard.workers.model.loader import build

    d = Path(directory)
    cfg = config_from_hf(json.loads((d / "config.json").read_text()))
    files = shard_files(d)
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors files")
    t0 = time.perf_counter()
    src = StagedSource.from_files(files, torch.device(device), ring)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    with torch.inference_mode():
        model = build(cfg, src, dtype, max_len, None, device=device)
    if parts is not None:
        parts["read_s"], parts["build_s"] = t1 - t0, time.perf_counter() - t1
    return model
