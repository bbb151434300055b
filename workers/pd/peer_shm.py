"""The same-host peer transfer: a hold's frames in a sealed memfd, its descriptor passed
over a Unix socket (SCM_RIGHTS).

Why this shape (security first): the decode worker is given a new memfd holding
exactly the held blocks' frames (the TCP path's bytes: header with key and xxh3
checksum + payload per block), never a mapping of the prefill worker's KV cache,
so a decode worker can read nothing but what a valid hold offers, and what it
reads once it cannot read again after later holds (a memfd is never reused).
The prefill side writes the frames with `pwritev` straight from the cache rows
(one kernel copy, no gather) and seals the file against shrinking and growing
before the descriptor leaves (so the mapping can never SIGBUS the reader), and
against writes once the last frame is in. The decode side maps it privately
(reads fault pages in 16 at a time; its scatter needs a writable buffer, which
it never writes), checks the seals, verifies every frame as the TCP path does,
and hands the payloads on; the mapping goes when the engine has copied them.

Pipelined: the prefill side reports each chunk of `CHUNK_BLOCKS` frames as it
is written, so the decode side verifies chunk k while chunk k+1 is written
(each on its own core). The socket is SOCK_SEQPACKET, one peer_wire message per
packet. Its name is abstract (`\\0kvyard-pd-<engine id>`): visible only inside
the prefill worker's network namespace, so two pods on one node fall back to
TCP, containers of one pod (or the local stack) use it; the decode side also
requires the listener's uid to be its own.

  decode -> prefill: {"remote_engine_id", "remote_request_id", "num_blocks"}
  prefill -> decode: {"ok": true, "num_blocks": n, "block_bytes": b} + the memfd
                     (or {"ok": false, ...}), then {"ready": k} per chunk written,
                     the last {"ready": n, "sealed": true}.
"""
from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import re
import socket
import struct
import time
from typing import Any, Iterable

import numpy as np

from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.kvstore.layout import Namespace

from .peer_wire import (HEAD_BYTES, MAX_MESSAGE, PeerError, check_head, message, parse_body,
                        verified_frame, write_all)

CHUNK_BLOCKS = 16
_IOV_MAX = 1024
_RECV_TIMEOUT_S = 10.0
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_ALL_SEALS = _SIZE_SEALS | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
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


async def recv_packet(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict[str, Any]:
    data = await loop.sock_recv(sock, HEAD_BYTES + MAX_MESSAGE)
    if not data:
        raise asyncio.IncompleteReadError(b"", HEAD_BYTES)
    return parse_packet(data)


# ---------------------------------------------------------------- prefill side
def send_hold(conn: socket.socket, chunks: Iterable[list[memoryview]], n: int,
              block_bytes: int) -> None:
    """In a thread: a fresh memfd sized for the n frames, size-sealed, passed with the
    ok packet; each chunk of frame buffers written in place, announced, then the file
    write-sealed. `chunks` yields (header, rows...) buffers for CHUNK_BLOCKS blocks at
    a time."""
    conn.settimeout(60.0)
    frame = HEADER_BYTES + block_bytes
    fd = os.memfd_create("kvyard-pd-hold", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, n * frame)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
        socket.send_fds(conn, [packet({"ok": True, "num_blocks": n,
                                       "block_bytes": block_bytes})], [fd])
        off = 0

        def pwritev(bufs: list[memoryview]) -> int:
            nonlocal off
            k = os.pwritev(fd, bufs, off)
            off += k
            return k
        for bufs in chunks:
            write_all(pwritev, bufs, _IOV_MAX)
            if off // frame < n:
                conn.sendall(packet({"ready": off // frame}))
        if off != n * frame:
            raise PeerError("transfer_failed", f"wrote {off} of {n * frame} bytes")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        conn.sendall(packet({"ready": n, "sealed": True}))
    finally:
        os.close(fd)


# ---------------------------------------------------------------- decode side
async def pull_shm(engine_id: str, request_id: str, namespace: Namespace,
                   block_hashes: list[int], timeout_s: float,
                   phases: dict[str, float] | None = None) -> list[memoryview]:
    """The blocks' payloads, verified, in order (views into the mapping). ShmUnavailable
    when there is no same-host endpoint (nothing was claimed), PeerError on any failure
    after that."""
    if not re.fullmatch(r"[0-9a-f]{32}", engine_id):  # only ever a kvyard endpoint's name
        raise ShmUnavailable(f"engine id {engine_id[:40]!r} is not a kvyard worker's")
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    try:
        try:
            await loop.sock_connect(sock, socket_name(engine_id))
        except OSError as e:
            raise ShmUnavailable(str(e)) from None
        _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
        if uid != os.getuid():
            raise ShmUnavailable(f"same-host endpoint belongs to uid {uid}")
        await loop.sock_sendall(sock, packet({"remote_engine_id": engine_id,
                                              "remote_request_id": request_id,
                                              "num_blocks": len(block_hashes)}))
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(_receive, sock, namespace, block_hashes, phases), timeout_s)
        except TimeoutError:
            raise PeerError("transfer_timeout",
                            f"same-host pull took over {timeout_s}s") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            raise PeerError("transfer_truncated", "same-host transfer ended early") from None
        except OSError as e:
            raise PeerError("transfer_failed", f"same-host transfer: {e}") from None
    finally:
        sock.close()


def _receive(sock: socket.socket, namespace: Namespace, block_hashes: list[int],
             phases: dict[str, float] | None) -> list[memoryview]:
    """In a thread: the descriptor with the ok packet, then each progress report's frames
    verified while the next chunk is written. Phases: claim (request to descriptor),
    transfer (to the last report, verifying meanwhile), verify (what is left after it)."""
    sock.settimeout(_RECV_TIMEOUT_S)
    t0 = time.perf_counter()
    data, fds, _, _ = socket.recv_fds(sock, HEAD_BYTES + MAX_MESSAGE, 1)
    try:
        if not data:
            raise asyncio.IncompleteReadError(b"", HEAD_BYTES)
        head = parse_packet(data)
        if head.get("ok") is not True:
            raise PeerError("transfer_refused", f"peer refused: {head.get('error')}")
        lay = namespace.layout
        n = head.get("num_blocks")
        if head.get("block_bytes") != lay.nbytes or not isinstance(n, int) \
                or not 0 < n <= len(block_hashes) or len(fds) != 1:
            raise PeerError("kv_mismatch", f"peer offers {n} blocks of "
                            f"{head.get('block_bytes')} bytes, expected {lay.nbytes}")
        frame = HEADER_BYTES + lay.nbytes
        mm = _map(fds[0], n * frame)
        t1 = time.perf_counter()
        buf = memoryview(np.frombuffer(mm, dtype=np.uint8)).cast("B")
        out: list[memoryview] = []
        sealed = False
        while not sealed:
            data = sock.recv(HEAD_BYTES + MAX_MESSAGE)
            if not data:
                raise asyncio.IncompleteReadError(b"", HEAD_BYTES)
            msg = parse_packet(data)
            ready, sealed = msg.get("ready"), msg.get("sealed") is True
            if not isinstance(ready, int) or not len(out) <= ready <= n \
                    or (sealed and ready != n):
                raise PeerError("transfer_corrupt", f"bad progress report {msg}")
            if sealed and fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & _ALL_SEALS != _ALL_SEALS:
                raise PeerError("transfer_corrupt", "shared block file not write-sealed")
            t2 = time.perf_counter()
            for i in range(len(out), ready):
                out.append(verified_frame(buf, i, frame, namespace, block_hashes[i]))
    finally:
        for fd in fds:
            os.close(fd)
    if phases is not None:
        t3 = time.perf_counter()
        phases.update(claim=t1 - t0, transfer=t2 - t1, verify=t3 - t2)
    return out


def _map(fd: int, size: int) -> mmap.mmap:
    """A private mapping of a size-sealed memfd of exactly `size` bytes (the seals keep
    it from shrinking under the mapping: no SIGBUS). Private and writable because the
    engine's scatter wants a writable buffer; nothing writes it."""
    st = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if st.st_size != size or seals & _SIZE_SEALS != _SIZE_SEALS:
        raise PeerError("transfer_corrupt", f"shared block file of {st.st_size} bytes, "
                        f"seals {seals:#x}: expected {size} bytes, size-sealed")
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
