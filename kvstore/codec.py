"""The stored form of one block: a fixed 80-byte header, then the raw payload.

Header (little-endian, struct "<4sHBB6IQQ32s"):
  magic b"KVYB" | version u16 | dtype code u8 | ndim u8 | shape 6 x u32 (unused
  dims 0) | payload length u64 | xxh3-64 of the payload u64 | the 32-byte key.

The payload is the block's elements in C order of `KVLayout.shape`, exactly
as the engine's tensors hold them; no pickling, so reads can hand out a
memoryview into the buffer they read. Every field is checked on every read
from SSD or Redis against what the reader expects: a wrong key (a renamed or
misplaced file), a wrong layout, a short payload or a bad checksum all mean
"corrupt", never "hit". DRAM holds payloads only and is not re-verified: it
never leaves the process.

A *framed* buffer is header room + payload in one contiguous buffer: callers
that allocate blocks that way (the connector does) let the store fill the
header in place and send or write the block as one buffer, with no copy.
"""
from __future__ import annotations

import functools
import struct

import xxhash

from kvyard.kvstore.layout import KEY_BYTES, KVLayout

MAGIC = b"KVYB"
VERSION = 1
HEADER = struct.Struct("<4sHBB6IQQ32s")
HEADER_BYTES = HEADER.size  # 80


class CorruptBlock(ValueError):
    """A stored block failed verification; the caller deletes it and counts a miss."""


_GIL_FREE_BYTES = 64 << 10


def checksum(payload, hold_gil: bool = False) -> int:
    """xxh3-64 of the payload. Blocks of 64 KiB and up go through python-xxhash's
    streaming object, whose update() releases the GIL around the hash loop (the
    one-shot `xxh3_64_intdigest` holds it): the same value, and a checksum in one
    thread does not stall the sender's or the I/O pool's other threads.
    `hold_gil`: the one-shot form whatever the size, for a thread that sends the
    block right after (the Redis sender): giving the GIL up and queueing for it
    again costs that thread more than the other threads gain."""
    if not hold_gil and memoryview(payload).nbytes >= _GIL_FREE_BYTES:
        return xxhash.xxh3_64(payload).intdigest()
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: bytes, layout: KVLayout, payload, hold_gil: bool = False) -> bytes:
    n = memoryview(payload).nbytes
    if n != layout.nbytes:
        raise ValueError(f"block payload is {n} bytes, layout needs {layout.nbytes}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key is {len(key)} bytes, needs {KEY_BYTES}")
    return _fixed_part(layout) + checksum(payload, hold_gil).to_bytes(8, "little") + key


def header_of(key: bytes, layout: KVLayout, payload_checksum: int) -> bytes:
    """The header of a block whose payload's xxh3-64 the caller computed (a payload
    sent from several buffers, hashed with `xxhash.xxh3_64().update` over each)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key is {len(key)} bytes, needs {KEY_BYTES}")
    return _fixed_part(layout) + payload_checksum.to_bytes(8, "little") + key


@functools.lru_cache(maxsize=64)
def _fixed_part(layout: KVLayout) -> bytes:
    """The header's first 40 bytes (magic .. payload length): the same for every block
    of a layout, so a read checks them with one comparison."""
    shape = list(layout.shape) + [0] * (6 - len(layout.shape))
    return HEADER.pack(MAGIC, VERSION, layout.dtype_code, len(layout.shape), *shape,
                       layout.nbytes, 0, bytes(KEY_BYTES))[:40]


def check_header(header, key: bytes, layout: KVLayout, payload) -> None:
    """CorruptBlock unless `header` describes exactly this key, layout and payload."""
    h = bytes(header[:HEADER_BYTES])
    if len(h) == HEADER_BYTES and h[:40] == _fixed_part(layout) and h[48:] == key \
            and memoryview(payload).nbytes == layout.nbytes:
        if checksum(payload) != int.from_bytes(h[40:48], "little"):
            raise CorruptBlock("checksum mismatch")
        return
    _explain(h, key, layout, payload)


def _explain(header: bytes, key: bytes, layout: KVLayout, payload) -> None:
    """The slow path: say precisely which field is wrong."""
    if len(header) < HEADER_BYTES:
        raise CorruptBlock(f"truncated header: {len(header)} bytes")
    magic, version, dcode, ndim, *rest = HEADER.unpack_from(header)
    shape, (n, csum, stored_key) = rest[:6], rest[6:]
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"bad magic/version {magic!r}/{version}")
    if stored_key != key or len(key) != KEY_BYTES:
        raise CorruptBlock("key mismatch")
    if dcode != layout.dtype_code or tuple(shape[:ndim]) != layout.shape or n != layout.nbytes:
        raise CorruptBlock(f"layout mismatch: dtype {dcode} shape {shape[:ndim]} len {n}")
    raise CorruptBlock(f"length {memoryview(payload).nbytes} != header's {n}")


def decode(blob, key: bytes, layout: KVLayout) -> memoryview:
    """The payload of `blob` (header + payload) as a read-only view (no copy), or CorruptBlock."""
    mv = memoryview(blob).cast("B")
    if mv.nbytes < HEADER_BYTES:
        raise CorruptBlock(f"truncated: {mv.nbytes} bytes, header alone is {HEADER_BYTES}")
    payload = mv[HEADER_BYTES:].toreadonly()
    check_header(mv[:HEADER_BYTES], key, layout, payload)
    return payload
