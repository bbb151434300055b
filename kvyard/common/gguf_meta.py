"""A GGUF header reader that stops before the tensors.

`gguf.GGUFReader` maps every tensor and builds numpy views for each of the
~100k vocabulary strings, which costs seconds on a 2-core box; the EPP and
the workers only need the tokenizer keys, so we walk the key/value section
ourselves with `struct` and never look past it. Format facts: GGUF v2/v3,
little- or big-endian (detected from the version field, as llama.cpp does).
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, Callable

# GGUF value type codes -> (struct format char, byte size) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


class _Cursor:
    """Reads values from the mapped header; one instance per file read."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview, endian: str) -> None:
        self.buf = buf
        self.pos = 0
        self.end = endian

    def scalar(self, code: int) -> Any:
        fmt, size = _SCALARS[code]
        (v,) = struct.unpack_from(self.end + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        n = self.u64()
        start = self.pos
        self.pos += n
        if self.pos > len(self.buf):
            raise GGUFFormatError("string runs past the end of the file")
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """A string array: the hot loop when loading a vocabulary (~100k items)."""
        buf, pos, out = self.buf, self.pos, []
        unpack = struct.Struct(self.end + "Q").unpack_from
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, code: int, keep: bool) -> Any:
        if code in _SCALARS:
            return self.scalar(code)
        if code == _STRING:
            return self.string()
        if code != _ARRAY:
            raise GGUFFormatError(f"unknown GGUF value type {code}")
        item = self.u32()
        count = self.u64()
        if item in _SCALARS:
            fmt, size = _SCALARS[item]
            start = self.pos
            self.pos += size * count
            if not keep:
                return None
            return list(struct.unpack_from(f"{self.end}{count}{fmt}", self.buf, start))
        if item == _STRING:
            if keep:
                return self.strings(count)
            for _ in range(count):  # skipping still has to walk the lengths
                self.pos += 8 + self.u64()
            return None
        return [self.value(item, keep) for _ in range(count)]


def read_metadata(path: str | Path, want: Callable[[str], bool]) -> dict[str, Any]:
    """The key/value pairs whose key `want` accepts; arrays of unwanted keys are skipped."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise GGUFFormatError(f"{path} is not a GGUF file")
            (version,) = struct.unpack_from("<I", buf, 4)
            endian = "<"
            if version & 0xFFFF == 0:  # a big-endian file reads as a huge version number
                endian = ">"
                (version,) = struct.unpack_from(">I", buf, 4)
            if version < 2:
                raise GGUFFormatError(f"GGUF version {version} is too old (need 2 or 3)")
            cur = _Cursor(buf, endian)
            cur.pos = 8
            cur.u64()  # tensor count: not needed
            n_kv = cur.u64()
            out: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                code = cur.u32()
                keep = want(key)
                v = cur.value(code, keep)
                if keep:
                    out[key] = v
            return out
        except (struct.error, IndexError) as e:
            raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from None
        finally:
            buf.release()
