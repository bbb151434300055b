"""The peer transfer's framing, shared by the prefill worker's server and the puller.

One TCP connection per pull:
  puller  -> server: message {"remote_engine_id", "remote_request_id", "num_blocks"}
  server  -> puller: message {"ok": true, "num_blocks": n, "block_bytes": b} (or
                     {"ok": false, "error": "..."}), then n kvstore codec frames
                     (80-byte header + payload), in chain order.
A message is b"KVYP", a little-endian u32 length, then that much JSON. Both
ends use raw non-blocking sockets (`loop.sock_*`): the frames go from the
sender's buffer to the receiver's without asyncio streams' extra copies. Every
frame's header carries its key (namespace digest + block hash), layout,
length and xxh3 checksum, which the puller checks against what it expects:
a corrupt, misplaced or foreign block is never loaded, and a truncated stream
ends in an incomplete read.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

MAGIC = b"KVYP"
_HEAD = struct.Struct("<4sI")
HEAD_BYTES = _HEAD.size
MAX_MESSAGE = 64 << 10


class PeerError(RuntimeError):
    """The transfer failed; `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def message(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return _HEAD.pack(MAGIC, len(data)) + data


def check_head(head: bytes) -> int:
    """The length of the JSON that follows a message head; PeerError if not one."""
    magic, n = _HEAD.unpack(head)
    if magic != MAGIC or n > MAX_MESSAGE:
        raise PeerError("transfer_corrupt", f"not a kvyard peer message ({magic!r}, {n} bytes)")
    return n


def parse_body(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise PeerError("transfer_corrupt", "peer message is not a JSON object")
    return doc


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       view: memoryview) -> None:
    """Fill `view` from a non-blocking socket; IncompleteReadError at EOF."""
    got = 0
    while got < len(view):
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise asyncio.IncompleteReadError(bytes(view[:min(got, 64)]), len(view))
        got += k


async def recv_message(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict[str, Any]:
    head = memoryview(bytearray(HEAD_BYTES))
    await recv_exactly(loop, sock, head)
    body = memoryview(bytearray(check_head(bytes(head))))
    await recv_exactly(loop, sock, body)
    return parse_body(bytes(body))
