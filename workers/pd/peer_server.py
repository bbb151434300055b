"""The prefill worker's peer transfer endpoints: decode workers pull held blocks here,
over TCP from anywhere in the pool, or from the same host through a sealed memfd
(`peer_shm.py`, an abstract Unix socket).

A hold is claimed once (a second pull of the same request is refused) and
given back when the connection ends, sent or not, so the prefill worker's
blocks are freed right after the pull instead of at the hold's timeout.
Blocks are sent from a thread with blocking calls (the copy loop runs in C, not
one event-loop turn per socket buffer's worth), so the event loop keeps serving
HTTP meanwhile. CPU caches: each block's K and V rows go out straight from the
cache tensors (sendmsg over the rows; held blocks are never written, so nothing
changes under the send), checksummed over the same rows. Device caches:
gathered into frames `CHUNK_BLOCKS` at a time, the next chunk framed while the
last one is sent. The request id is an unguessable capability
(uuid4), valid until the hold ends; the port should be reachable from the
pool only (a NetworkPolicy in Kubernetes, loopback in the local stack).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvyard.kvstore.codec import HEADER_BYTES, encode_header, header_of
from kvyard.kvstore.layout import Namespace

from . import peer_shm, peer_stream
from .peer_wire import PeerError, message, recv_message, write_all

log = logging.getLogger("kvyard.pd")
CHUNK_BLOCKS = 16
REQUEST_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 60.0
_SNDBUF = 4 << 20
_IOV_MAX = 1024            # Linux's UIO_MAXIOV
_IOV_BATCH = 960           # buffers gathered before a sendmsg (a block is 1 + 2 x layers)
_SENDERS = 64              # threads: a streamed pull waits in one for its prefill's chunks


@dataclass(slots=True)
class PeerServer:
    handoff: Any                 # the engine's handoff.Handoff: claim, wait, finish, gather
    namespace: Namespace
    engine_id: str
    host: str = "127.0.0.1"
    port: int = 0                # 0: an ephemeral port, known after start
    shm: bool = True             # also serve same-host pulls (peer_shm.py)
    sent_blocks: int = field(default=0, init=False)
    pulled: int = field(default=0, init=False)    # holds sent in full
    aborted: int = field(default=0, init=False)   # holds claimed, the transfer cut short
    _sock: socket.socket | None = field(default=None, init=False)
    _unix: socket.socket | None = field(default=None, init=False)
    _accepting: list[asyncio.Task] = field(default_factory=list, init=False)
    _conns: set[asyncio.Task] = field(default_factory=set, init=False)
    _block_pieces: list[np.ndarray] | None = field(default=None, init=False)
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        _SENDERS, thread_name_prefix="kvyard-pd-send"), init=False)

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accepting.append(asyncio.ensure_future(self._accept(sock, False)))
        if self.shm:
            self._unix = peer_shm.listen(self.engine_id)
            if self._unix is not None:
                self._accepting.append(asyncio.ensure_future(self._accept(self._unix, True)))
        return self.port

    @property
    def shm_ready(self) -> bool:
        return self._unix is not None

    async def stop(self) -> None:
        tasks = [*self._accepting, *self._conns]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in (self._sock, self._unix):
            if s is not None:
                s.close()
        self._sock = self._unix = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _accept(self, listener: socket.socket, shm: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            task = asyncio.ensure_future(self._serve(conn, shm))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket, shm: bool = False) -> None:
        loop = asyncio.get_running_loop()
        run = functools.partial(loop.run_in_executor, self._pool)
        rid = None
        pending: asyncio.Future | None = None
        sent = False
        fd: int | None = None    # shm: the puller's buffer
        try:
            if shm:
                req, fd = await run(peer_shm.recv_request, conn, REQUEST_TIMEOUT_S)
                conn.setblocking(False)
            else:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
                req = await asyncio.wait_for(recv_message(loop, conn), REQUEST_TIMEOUT_S)
            if req.get("remote_engine_id") != self.engine_id:
                raise PeerError("unknown_engine", "remote_engine_id is not this worker's")
            stream = req.get("stream") is True
            want = max(1, int(req.get("num_blocks", 0)))
            frame = HEADER_BYTES + self.namespace.layout.nbytes
            if shm:  # before the claim: a bad buffer costs nobody the hold
                peer_shm.check_target(fd, want * frame)
            rid = str(req.get("remote_request_id"))
            hold = await run(self.handoff.claim, rid,
                             peer_stream.STREAM_WAIT_S if stream else 0.0)
            if hold is None:
                rid = None
                raise PeerError("unknown_request", "no such hold (pulled already, or expired)")
            if stream:
                pending = asyncio.ensure_future(run(self._stream, conn, fd, hold, want))
            else:
                if hold.growing:   # an offer is made once the prefill ends: rarely waits
                    await run(self._until_complete, hold)
                n = min(int(req.get("num_blocks", len(hold.block_ids))), len(hold.block_ids))
                lay = self.namespace.layout
                if shm:
                    peer_shm.check_target(fd, n * frame)   # a request without num_blocks
                    pending = asyncio.ensure_future(run(self._send_shm, conn, fd, hold, n))
                else:
                    await loop.sock_sendall(conn, message({"ok": True, "num_blocks": n,
                                                           "block_bytes": lay.nbytes}))
                    pending = asyncio.ensure_future(run(self._send, conn, hold, n))
            await pending
            pending = None
            sent = True
        except PeerError as e:
            if pending is not None:   # a streamed pull's thread failed: it sent whole ranges
                await asyncio.gather(pending, return_exceptions=True)
                pending = None
            try:
                conn.setblocking(False)
                await loop.sock_sendall(conn, message({"ok": False, "error": str(e),
                                                       "reason": e.reason}))
            except OSError:
                pass
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ValueError,
                OSError) as e:
            log.warning("peer transfer of %s ended early: %s", rid, e)
        finally:
            if pending is not None:  # its thread reads held blocks: done before they go back
                await asyncio.gather(pending, return_exceptions=True)
            if rid is not None:
                if sent:
                    self.pulled += 1
                else:
                    self.aborted += 1
                self.handoff.finish(rid)
            if fd is not None:
                os.close(fd)    # never kept: the buffer is the puller's
            conn.close()

    def _until_complete(self, hold: Any) -> None:
        while hold.growing:
            self.handoff.wait(hold, len(hold.block_ids), SEND_TIMEOUT_S)

    def _stream(self, conn: socket.socket, fd: int | None, hold: Any, n: int) -> None:
        """In a thread: a streamed pull (peer_stream.py), each range of blocks sent (TCP)
        or written into the puller's buffer (same host) as the engine publishes it."""
        conn.settimeout(SEND_TIMEOUT_S)
        lay = self.namespace.layout
        conn.sendall(message({"ok": True, "stream": True, "num_blocks": n,
                              "block_bytes": lay.nbytes}))
        frame = HEADER_BYTES + lay.nbytes
        pieces = self._pieces()
        total = 0
        for s, e, growing in peer_stream.ranges(self.handoff.wait, hold, n, SEND_TIMEOUT_S):
            head = peer_stream.range_message(hold, s, e, growing)
            if fd is None:
                conn.sendall(head)
                for c in range(s, e, CHUNK_BLOCKS):
                    _sendmsg_all(conn, self._range_bufs(pieces, hold, c, min(c + CHUNK_BLOCKS, e)))
            else:   # announced first, as over TCP: the puller times the tail from it
                conn.sendall(head)
                off = s * frame
                for c in range(s, e, CHUNK_BLOCKS):
                    off += peer_shm.pwrite_all(fd, self._range_bufs(
                        pieces, hold, c, min(c + CHUNK_BLOCKS, e)), off)
                conn.sendall(message({"ready": e}))
            self.sent_blocks += e - s
            total = e
        conn.sendall(message({"end": True, "num_blocks": total}))

    def _range_bufs(self, pieces: list[np.ndarray] | None, hold: Any, s: int,
                    e: int) -> list[memoryview]:
        """Held blocks s..e as frame buffers: over the cache rows (CPU caches), else
        gathered into a fresh frame buffer (device caches)."""
        if pieces is not None:
            return [v for b in range(s, e) for v in self._block_bufs(pieces, hold, b)]
        frames = np.empty((e - s, HEADER_BYTES + self.namespace.layout.nbytes), dtype=np.uint8)
        self._frames(hold.block_ids[s:e], hold.block_hashes[s:e], frames)
        return [memoryview(frames).cast("B")]

    def _send(self, conn: socket.socket, hold: Any, n: int) -> None:
        conn.settimeout(SEND_TIMEOUT_S)
        t0 = time.perf_counter()
        pieces = self._pieces()
        if pieces is not None:
            self._send_in_place(conn, pieces, hold, n)
        else:
            self._send_gathered(conn, hold, n)
        log.debug("sent %d blocks in %.1f ms (%s)", n, (time.perf_counter() - t0) * 1e3,
                  "in place" if pieces is not None else "gathered")

    def _pieces(self) -> list[np.ndarray] | None:
        if self._block_pieces is None:
            self._block_pieces = self.handoff.block_pieces() or []
        return self._block_pieces or None

    def _send_shm(self, conn: socket.socket, fd: int, hold: Any, n: int) -> None:
        """In a thread: the held frames into a same-host puller's buffer, a chunk at a time
        (CPU caches straight from the rows, device caches gathered)."""
        pieces = self._pieces()

        def chunks():
            for s in range(0, n, peer_shm.CHUNK_BLOCKS):
                e = min(s + peer_shm.CHUNK_BLOCKS, n)
                yield self._range_bufs(pieces, hold, s, e)
                self.sent_blocks += e - s
        peer_shm.send_hold(conn, fd, chunks(), n, self.namespace.layout.nbytes)

    def _block_bufs(self, pieces: list[np.ndarray], hold: Any, i: int) -> list[memoryview]:
        """Held block i's frame as buffers over the cache: its header (checksum hashed over
        the rows) then, per layer, its K and V rows."""
        b, h = hold.block_ids[i], hold.block_hashes[i]
        rows = [memoryview(p[kv, b]) for p in pieces for kv in (0, 1)]
        x = xxhash.xxh3_64()
        for r in rows:
            x.update(r)
        head = header_of(self.namespace.key(h), self.namespace.layout, x.intdigest())
        return [memoryview(head), *rows]

    def _send_in_place(self, conn: socket.socket, pieces: list[np.ndarray], hold: Any,
                       n: int) -> None:
        """CPU caches: each block goes out as its header plus, per layer, its K and V
        rows straight from the cache tensors (sendmsg, no gather copy); the checksum is
        hashed over the same rows."""
        bufs: list[memoryview] = []
        for i in range(n):
            bufs.extend(self._block_bufs(pieces, hold, i))
            if len(bufs) >= _IOV_BATCH:
                _sendmsg_all(conn, bufs)
                bufs = []
            self.sent_blocks += 1
        if bufs:
            _sendmsg_all(conn, bufs)

    def _send_gathered(self, conn: socket.socket, hold: Any, n: int) -> None:
        """In a thread: gather, checksum and send the held blocks, a chunk at a time, with
        blocking sendall calls (the copy loop runs in C, not one event-loop turn per
        socket buffer's worth), bounded by the socket's timeout. A second thread frames
        the next chunk while this one waits on the socket; two frame buffers, reused
        (a chunk's buffer is overwritten only after sendall handed it to the kernel)."""
        frame = HEADER_BYTES + self.namespace.layout.nbytes
        bufs = [np.empty((min(CHUNK_BLOCKS, n), frame), dtype=np.uint8) for _ in range(2)]
        starts = list(range(0, n, CHUNK_BLOCKS))

        def frame_chunk(k: int) -> int:
            s = starts[k]
            ids = hold.block_ids[s:min(s + CHUNK_BLOCKS, n)]
            self._frames(ids, hold.block_hashes[s:s + len(ids)], bufs[k % 2])
            return len(ids)
        with ThreadPoolExecutor(1, thread_name_prefix="kvyard-pd-frames") as pool:
            ahead = pool.submit(frame_chunk, 0)
            for k in range(len(starts)):
                m = ahead.result()
                if k + 1 < len(starts):
                    ahead = pool.submit(frame_chunk, k + 1)
                conn.sendall(memoryview(bufs[k % 2][:m]).cast("B"))
                self.sent_blocks += m

    def _frames(self, block_ids: list[int], hashes: list[int], out: np.ndarray) -> None:
        lay = self.namespace.layout
        frames = out[:len(block_ids)]
        self.handoff.gather(block_ids, frames[:, HEADER_BYTES:])
        for row, h in zip(frames, hashes):
            row[:HEADER_BYTES] = np.frombuffer(
                encode_header(self.namespace.key(h), lay, row[HEADER_BYTES:]), dtype=np.uint8)


def _sendmsg_all(conn: socket.socket, bufs: list[memoryview]) -> None:
    write_all(conn.sendmsg, bufs, _IOV_MAX)
