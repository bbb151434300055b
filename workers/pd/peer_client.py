"""Pulling a prefill worker's held blocks over its peer endpoint (peer_wire.py).

Each frame is checked against the key the puller expects for block i (its
namespace digest + the offer's hash i) and its layout before its checksum:
any mismatch, short stream or peer error raises `PeerError`, whose reason
becomes the fallback metric's label; nothing partial is ever handed on.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import numpy as np

from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.kvstore.layout import Namespace

from .peer_wire import (PeerError, message, offered_blocks, recv_all_into, recv_message,
                        verified_frame)

log = logging.getLogger("kvyard.pd")
_RCVBUF = 4 << 20
_RECV_TIMEOUT_S = 10.0  # per recv: a stalled peer frees the thread


async def pull(host: str, port: int, engine_id: str, request_id: str,
               namespace: Namespace, block_hashes: list[int],
               timeout_s: float, phases: dict[str, float] | None = None) -> list[memoryview]:
    """The blocks' payloads, verified, in order; PeerError on any failure. `phases`
    gets the seconds of claim (connect to the ok), transfer and verify."""
    try:
        return await asyncio.wait_for(
            _pull(host, port, engine_id, request_id, namespace, block_hashes,
                  {} if phases is None else phases), timeout_s)
    except TimeoutError:
        raise PeerError("transfer_timeout", f"pull from {host}:{port} took over {timeout_s}s") \
            from None
    except asyncio.IncompleteReadError as e:
        raise PeerError("transfer_truncated",
                        f"stream from {host}:{port} ended early ({len(e.partial)} bytes)") from None
    except (ConnectionError, OSError) as e:
        raise PeerError("transfer_failed", f"peer {host}:{port}: {e}") from None


async def _pull(host: str, port: int, engine_id: str, request_id: str,
                namespace: Namespace, block_hashes: list[int],
                phases: dict[str, float]) -> list[memoryview]:
    """Connect and ask on the event loop, receive the frames in a thread (an asyncio
    StreamReader would copy each read into its buffer, out again, and memmove what
    is behind it on every read)."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, message({"remote_engine_id": engine_id,
                                               "remote_request_id": request_id,
                                               "num_blocks": len(block_hashes)}))
        head = await recv_message(loop, sock)
        n = offered_blocks(head, namespace, len(block_hashes))
        lay = namespace.layout
        frame = HEADER_BYTES + lay.nbytes
        phases["claim"] = time.perf_counter() - t0
        return await asyncio.to_thread(_receive, sock, n, frame, namespace, block_hashes[:n],
                                       phases)
    finally:
        sock.close()


def _receive(sock: socket.socket, n: int, frame: int, namespace: Namespace,
             block_hashes: list[int], phases: dict[str, float]) -> list[memoryview]:
    """In a thread: blocking recv_into straight into one buffer for every frame (the
    loop runs at C speed, not one event-loop turn per socket buffer's worth; the
    caller's wait_for bounds the time, the socket's timeout this thread), then
    verify."""
    sock.settimeout(_RECV_TIMEOUT_S)
    t0 = time.perf_counter()
    buf = memoryview(np.empty(n * frame, dtype=np.uint8)).cast("B")  # not zeroed first
    recv_all_into(sock, buf)
    t1 = time.perf_counter()
    out = _verify(buf, frame, namespace, block_hashes)
    phases.update(transfer=t1 - t0, verify=time.perf_counter() - t1)
    return out


def _verify(buf: memoryview, frame: int, namespace: Namespace,
            block_hashes: list[int]) -> list[memoryview]:
    return [verified_frame(buf, i, frame, namespace, h) for i, h in enumerate(block_hashes)]
