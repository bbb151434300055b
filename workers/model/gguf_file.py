"""Reading a GGUF file fast: our own header walk plus torch dequantisation.

`gguf.GGUFReader` builds a numpy view per array element, which costs seconds
on the demo file's 98k tokenizer strings. The header format is small and
stable, so we walk it with `struct` and skip the string arrays we never use
(the tokenizer reads its own). PyPI `gguf` still supplies the type tables and
the dequantiser for quant types we have no torch fast path for (K-quants).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]            # torch order (outermost first)
    qtype: GGMLQuantizationType
    offset: int                       # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata and tensor index of one GGUF file; tensor bytes are read on demand."""

    __slots__ = ("path", "meta", "tensors", "_buf")

    def __init__(self, path: str | Path, keep_string_arrays: bool = False) -> None:
        self.path = Path(path)
        # A private (copy-on-write) map: writable as torch.frombuffer needs, pages read lazily.
        with open(self.path, "rb") as fh:
            self._buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        self.meta: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._parse(keep_string_arrays)

    def _parse(self, keep_strings: bool) -> None:
        buf = self._buf
        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{self.path}: not a GGUF v2+ file")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24

        def read_str(p: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, p)
            return buf[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n

        def read_value(p: int, vtype: int) -> tuple[Any, int]:
            if vtype == _STRING:
                return read_str(p)
            if vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                if etype in _NP:
                    arr = np.frombuffer(buf, dtype=_NP[etype], count=count, offset=p)
                    return arr.tolist(), p + arr.nbytes
                items = [] if (etype == _STRING and keep_strings) or etype != _STRING else None
                for _ in range(count):
                    if etype == _STRING and not keep_strings:  # skip: length-prefixed bytes
                        (n,) = struct.unpack_from("<Q", buf, p)
                        p += 8 + n
                    else:
                        v, p = read_value(p, etype)
                        items.append(v)  # type: ignore[union-attr]
                return items, p
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)

        for _ in range(n_kv):
            key, pos = read_str(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            self.meta[key], pos = read_value(pos + 4, vtype)

        infos = []
        for _ in range(n_tensors):
            name, pos = read_str(pos)
            (nd,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{nd}Q", buf, pos + 4)
            qtype, off = struct.unpack_from("<IQ", buf, pos + 4 + 8 * nd)
            pos += 4 + 8 * nd + 12
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), off))
        align = int(self.meta.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        for name, shape, qtype, off in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            self.tensors[name] = GGUFTensor(name, shape, qtype, data_start + off, n // block * type_size)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor viewing the file buffer (no copy)."""
        t = self.tensors[name]
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=t.nbytes, offset=t.offset)

    def load(self, name: str) -> torch.Tensor:
        """The tensor dequantised to float32 (F16/BF16 keep their dtype), torch-order shape."""
        t = self.tensors[name]
        return dequantize(self.raw(name), t.qtype, t.shape)


def _f16(raw: torch.Tensor, lo: int) -> torch.Tensor:
    """Block scales: two bytes at column `lo` of [n_blocks, type_size] as float32 [n_blocks, 1]."""
    return raw[:, lo:lo + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 16] packed bytes -> [n_blocks, 32] float32 values 0..15.

    ggml packs element j in the low nibble and j+16 in the high nibble of
    byte j. Masking four bytes at a time as int32 is ~5x faster than uint8
    ops, and writing into halves of one float buffer saves a cat and a cast."""
    w = qs.contiguous().view(torch.int32)
    out = torch.empty(qs.shape[0], 32, dtype=torch.float32)
    out[:, :16] = (w & 0x0F0F0F0F).view(torch.uint8)
    out[:, 16:] = ((w >> 4) & 0x0F0F0F0F).view(torch.uint8)
    return out


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    Q = GGMLQuantizationType
    if qtype == Q.F32:
        return raw.view(torch.float32).view(shape)
    if qtype == Q.F16:
        return raw.view(torch.float16).view(shape)
    if qtype == Q.BF16:
        return raw.view(torch.bfloat16).view(shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        b = raw.view(-1, type_size)
        if qtype == Q.Q8_0:
            out = b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)
        elif qtype == Q.Q4_0:
            out = _nibbles(b[:, 2:]).sub_(8.0).mul_(_f16(b, 0))
        else:  # in place: no third temporary of the tensor's size
            out = _nibbles(b[:, 4:]).mul_(_f16(b, 0)).add_(_f16(b, 2))
        return out.view(shape)
    # Rarer types (K-quants, IQ*): PyPI gguf's numpy reference.
    arr = np_dequantize(raw.numpy().reshape(-1, shape[-1] // block * type_size), qtype)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).view(shape)


def int4_parts(raw: torch.Tensor, qtype: GGMLQuantizationType,
               shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Q4_0/Q4_1 as (codes 0..15 int32 [N, K], scale [N, K/32], zero [N, K/32]) float32,
    with weight = (code - 8) * scale + zero: torch's int4 weight-only matmul convention,
    which holds both formats exactly. None for any other type."""
    parts = quant_parts(raw, qtype, shape) if qtype != GGMLQuantizationType.Q8_0 else None
    if parts is None:
        return None
    codes, d, m, _, off = parts  # (code + off) * d + m == (code - 8) * d + (m + (8 + off) d)
    return codes.to(torch.int32), d, m + (8 + off) * d


def quant_parts(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float] | None:
    """Q4_0/Q4_1/Q8_0 as (codes [N, K] uint8 (4-bit) or int8, d [N, K/32], m [N, K/32]
    float32, bits, offset): weight = (code + offset) * d + m exactly as `dequantize`
    computes it, for workers/cpu_ops/gemm_quant.h. None for any other type."""
    Q = GGMLQuantizationType
    if qtype not in (Q.Q4_0, Q.Q4_1, Q.Q8_0) or len(shape) != 2 or shape[1] % 32:
        return None
    _, type_size = GGML_QUANT_SIZES[qtype]
    b = raw.view(-1, type_size)
    n, k = shape
    d = _f16(b, 0)
    if qtype == Q.Q8_0:
        codes, m, bits, off = b[:, 2:].contiguous().view(torch.int8), torch.zeros_like(d), 8, 0.0
    else:
        lo = 2 if qtype == Q.Q4_0 else 4
        codes = _nibbles(b[:, lo:]).to(torch.uint8)
        m = torch.zeros_like(d) if qtype == Q.Q4_0 else _f16(b, 2)
        bits, off = 4, (-8.0 if qtype == Q.Q4_0 else 0.0)
    return codes.reshape(n, k), d.view(n, k // 32), m.view(n, k // 32), bits, off
