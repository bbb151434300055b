"""The peer transfer's framing, shared by the prefill worker's server and the puller.

One TCP connection per pull:
  puller  -> server: message {"remote_engine_id", "remote_request_id", "num_blocks"}
  server  -> puller: message {"ok": true, "num_blocks": n, "block_bytes": b} (or
                     {"ok": false, "error": "..."}), then n kvstore codec frames
                     (80-byte header + payload), in chain order.
A message is b"KVYP", a little-endian u32 length, then that much JSON. Every
frame's header carries its key (namespace digest + block hash), layout,
length and xxh3 checksum, which the puller checks against what it expects:
a corrupt, misplaced or foreign block is never loaded, and a truncated stream
ends in an incomplete read.
"""
from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

MAGIC = b"KVYP"
_HEAD = struct.Struct("<4sI")
MAX_MESSAGE = 64 << 10


class PeerError(RuntimeError):
    """The transfer failed; `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def message(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return _HEAD.pack(MAGIC, len(data)) + data


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    magic, n = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    if magic != MAGIC or n > MAX_MESSAGE:
        raise PeerError("transfer_corrupt", f"not a kvyard peer message ({magic!r}, {n} bytes)")
    doc = json.loads(await reader.readexactly(n))
    if not isinstance(doc, dict):
        raise PeerError("transfer_corrupt", "peer message is not an object")
    return doc
