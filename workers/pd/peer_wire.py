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
from typing import Any, Callable

from kvyard.kvstore.codec import HEADER_BYTES, CorruptBlock, check_header
from kvyard.kvstore.layout import Namespace

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


def recv_all_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a blocking socket (in a thread); IncompleteReadError at EOF."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise asyncio.IncompleteReadError(bytes(view[:min(got, 64)]), len(view))
        got += k


async def recv_message(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict[str, Any]:
    head = memoryview(bytearray(HEAD_BYTES))
    await recv_exactly(loop, sock, head)
    body = memoryview(bytearray(check_head(bytes(head))))
    await recv_exactly(loop, sock, body)
    return parse_body(bytes(body))


def verified_frame(buf: memoryview, i: int, frame: int, namespace: Namespace,
                   block_hash: int) -> memoryview:
    """Frame i's payload, once its header matches the key and layout expected for block i
    and its checksum the payload (xxh3 releases the GIL on blocks this size)."""
    mv = buf[i * frame:(i + 1) * frame]
    payload = mv[HEADER_BYTES:]
    try:
        check_header(mv[:HEADER_BYTES], namespace.key(block_hash), namespace.layout, payload)
    except CorruptBlock as e:
        raise PeerError("transfer_corrupt", f"block {i}: {e}") from None
    return payload


def write_all(write: Callable[[list[memoryview]], int], bufs: list[memoryview],
              iov_max: int = 1024) -> int:
    """Gathered writes (sendmsg, pwritev) until every buffer is out: a call may stop
    anywhere, mid-buffer too. Returns the bytes written."""
    i = total = 0
    while i < len(bufs):
        k = write(bufs[i:i + iov_max])
        total += k
        while k and i < len(bufs):
            if k >= bufs[i].nbytes:
                k -= bufs[i].nbytes
                i += 1
            else:
                bufs[i] = bufs[i][k:]
                k = 0
    return total


def offered_blocks(head: dict[str, Any], namespace: Namespace, wanted: int) -> int:
    """How many blocks the server's ok says it sends; PeerError on a refusal or an offer
    that does not fit (another layout, none, more than asked)."""
    if head.get("ok") is not True:
        raise PeerError("transfer_refused", f"peer refused: {head.get('error')}")
    lay = namespace.layout
    n = head.get("num_blocks")
    if head.get("block_bytes") != lay.nbytes or not isinstance(n, int) or not 0 < n <= wanted:
        raise PeerError("kv_mismatch", f"peer offers {n} blocks of "
                        f"{head.get('block_bytes')} bytes, expected {lay.nbytes}")
    return n
