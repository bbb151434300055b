"""The same-host peer transfer: the prefill worker writes a hold's frames into a memfd
the decode worker owns and passes it over a Unix socket (SCM_RIGHTS).

Why this shape (security first): the decode worker gets exactly the held blocks'
frames (the TCP path's bytes: header with key and xxh3 checksum + payload per
block), never a view of the prefill worker's KV cache, so it can read nothing
but what a valid hold offers. The buffer is the decode worker's (`shm_pool.py`:
reused per prefill peer, so a transfer is a copy, not a page allocation per
4 KiB; sealed against resizing, so a peer cannot truncate it under the decode
worker's mapping). The prefill worker never maps it: it `pwritev`s each block's
header and its K/V rows straight from the cache rows into it (one kernel copy,
no gather; a hostile descriptor can cost it nothing but a failed write) and
closes its copy of the descriptor when done. The decode worker verifies every
frame as over TCP, chunk k while chunk k+1 is written (each on its own core),
then the engine copies the blocks from the buffer into its cache.

The socket is SOCK_SEQPACKET, one peer_wire message per packet. Its name is
abstract (`\\0kvyard-pd-<engine id>`): visible only inside the prefill worker's
network namespace, so two pods on one node fall back to TCP, containers of one
pod (or the local stack) use it; the decode side also requires the listener's
uid to be its own. The hold's capability (engine id + request id) is the same
as over TCP.

  decode -> prefill: {"remote_engine_id", "remote_request_id", "num_blocks"} + its
                     buffer's descriptor (at least num_blocks frames)
  prefill -> decode: {"ok": true, "num_blocks": n, "block_bytes": b} (or {"ok":
                     false, ...}), then {"ready": k} per chunk written, the last
                     {"ready": n, "done": true}.
"""
from __future__ import annotations

import asyncio
import os
import re
import socket
import stat
import struct
import time
from typing import Any, Iterable

from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.kvstore.layout import Namespace

from .peer_wire import (HEAD_BYTES, MAX_MESSAGE, PeerError, check_head, message, parse_body,
                        offered_blocks, verified_frame, write_all)
from .shm_pool import ShmPool

CHUNK_BLOCKS = 16
_IOV_MAX = 1024
_RECV_TIMEOUT_S = 10.0
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class ShmUnavailable(Exception):
    """No same-host endpoint for this offer (another host or namespace, or none at all):
    the caller uses TCP instead. Raised only before a hold is claimed."""


def socket_name(engine_id: str) -> str:
    return f"\0kvyard-pd-{engine_id}"


def listen(engine_id: str) -> socket.socket | None:
    """The prefill worker's same-host endpoint, or None where AF_UNIX is unavailable."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(socket_name(engine_id))
    except OSError:
        return None
    sock.listen(64)
    sock.setblocking(False)
    return sock


def packet(obj: dict[str, Any]) -> bytes:
    return message(obj)


def parse_packet(data: bytes) -> dict[str, Any]:
    if len(data) < HEAD_BYTES or check_head(data[:HEAD_BYTES]) != len(data) - HEAD_BYTES:
        raise PeerError("transfer_corrupt", "not a whole kvyard peer packet")
    return parse_body(data[HEAD_BYTES:])


def recv_request(sock: socket.socket, timeout_s: float) -> tuple[dict[str, Any], int | None]:
    """In a thread: the puller's request and the descriptor that came with it (the
    caller closes it)."""
    sock.settimeout(timeout_s)
    data, fds, _, _ = socket.recv_fds(sock, HEAD_BYTES + MAX_MESSAGE, 1)
    fd = fds[0] if fds else None
    for extra in fds[1:]:
        os.close(extra)
    try:
        if not data:
            raise asyncio.IncompleteReadError(b"", HEAD_BYTES)
        return parse_packet(data), fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


# ---------------------------------------------------------------- prefill side
def check_target(fd: int | None, size: int) -> None:
    """The puller's buffer must be a regular file (a memfd) of at least `size` bytes."""
    if fd is None:
        raise PeerError("transfer_refused", "no buffer descriptor came with the request")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise PeerError("transfer_refused", f"the buffer is not a file of {size} bytes")


def send_hold(conn: socket.socket, fd: int, chunks: Iterable[list[memoryview]], n: int,
              block_bytes: int) -> None:
    """In a thread: each chunk of frame buffers written into the puller's buffer in place,
    announced; `chunks` yields (header, rows...) buffers for CHUNK_BLOCKS blocks at a
    time."""
    conn.settimeout(60.0)
    frame = HEADER_BYTES + block_bytes
    conn.sendall(packet({"ok": True, "num_blocks": n, "block_bytes": block_bytes}))
    off = 0
    for bufs in chunks:
        off += pwrite_all(fd, bufs, off)
        if off // frame < n:
            conn.sendall(packet({"ready": off // frame}))
    if off != n * frame:
        raise PeerError("transfer_failed", f"wrote {off} of {n * frame} bytes")
    conn.sendall(packet({"ready": n, "done": True}))


def pwrite_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Gathered writes of every buffer into the puller's buffer from `offset`; the
    bytes written."""
    off = offset

    def pwritev(chunk: list[memoryview]) -> int:
        nonlocal off
        k = os.pwritev(fd, chunk, off)
        off += k
        return k
    return write_all(pwritev, bufs, _IOV_MAX)


# ---------------------------------------------------------------- decode side
async def connect(engine_id: str) -> socket.socket:
    """A connection to the prefill worker's same-host endpoint, run by this uid;
    ShmUnavailable where there is none."""
    if not re.fullmatch(r"[0-9a-f]{32}", engine_id):  # only ever a kvyard endpoint's name
        raise ShmUnavailable(f"engine id {engine_id[:40]!r} is not a kvyard worker's")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    try:
        try:
            await asyncio.get_running_loop().sock_connect(sock, socket_name(engine_id))
        except OSError as e:
            raise ShmUnavailable(str(e)) from None
        _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
        if uid != os.getuid():
            raise ShmUnavailable(f"same-host endpoint belongs to uid {uid}")
    except BaseException:
        sock.close()
        raise
    return sock


async def pull_shm(engine_id: str, request_id: str, namespace: Namespace,
                   block_hashes: list[int], timeout_s: float, pool: ShmPool,
                   phases: dict[str, float] | None = None) -> list[memoryview]:
    """The blocks' payloads, verified, in order (views into a pooled buffer, given back
    once the last is gone). ShmUnavailable when there is no same-host endpoint (nothing
    was claimed), PeerError on any failure after that."""
    t0 = time.perf_counter()
    sock = await connect(engine_id)
    try:
        frame = HEADER_BYTES + namespace.layout.nbytes
        buf, view = await asyncio.to_thread(pool.take, engine_id, len(block_hashes) * frame)
        ok = False
        try:
            socket.send_fds(sock, [packet({"remote_engine_id": engine_id,
                                           "remote_request_id": request_id,
                                           "num_blocks": len(block_hashes)})], [buf.fd])
            out = await asyncio.wait_for(
                asyncio.to_thread(_receive, sock, view, namespace, block_hashes, t0, phases),
                timeout_s)
            ok = True
            return out
        except TimeoutError:
            raise PeerError("transfer_timeout",
                            f"same-host pull took over {timeout_s}s") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            raise PeerError("transfer_truncated", "same-host transfer ended early") from None
        except OSError as e:
            raise PeerError("transfer_failed", f"same-host transfer: {e}") from None
        finally:
            if not ok:
                pool.drop(buf)   # its peer may still write it: never reused
    finally:
        sock.close()


def _receive(sock: socket.socket, view: Any, namespace: Namespace, block_hashes: list[int],
             t0: float, phases: dict[str, float] | None) -> list[memoryview]:
    """In a thread: the ok, then each progress report's frames verified while the next
    chunk is written. Phases: claim (connect to the ok), transfer (to the last report,
    verifying meanwhile), verify (what is left after it)."""
    sock.settimeout(_RECV_TIMEOUT_S)
    head = recv_packet(sock)
    n = offered_blocks(head, namespace, len(block_hashes))
    lay = namespace.layout
    t1 = time.perf_counter()
    frame = HEADER_BYTES + lay.nbytes
    mem = memoryview(view).cast("B")
    out: list[memoryview] = []
    done = False
    while not done:
        msg = recv_packet(sock)
        ready, done = msg.get("ready"), msg.get("done") is True
        if not isinstance(ready, int) or not len(out) <= ready <= n or (done and ready != n):
            raise PeerError("transfer_corrupt", f"bad progress report {msg}")
        t2 = time.perf_counter()
        for i in range(len(out), ready):
            out.append(verified_frame(mem, i, frame, namespace, block_hashes[i]))
    if phases is not None:
        phases.update(claim=t1 - t0, transfer=t2 - t1, verify=time.perf_counter() - t2)
    return out


def recv_packet(sock: socket.socket) -> dict[str, Any]:
    """One peer_wire message from a blocking SOCK_SEQPACKET socket (in a thread)."""
    data = sock.recv(HEAD_BYTES + MAX_MESSAGE)
    if not data:
        raise asyncio.IncompleteReadError(b"", HEAD_BYTES)
    return parse_packet(data)
