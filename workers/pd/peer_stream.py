"""Streamed handoffs: the decode worker pulls a hold while the prefill worker still
computes the prompt, chunk by chunk, so most of the KV has arrived when the prefill
ends and only its last chunk's blocks are on the critical path.

How the two sides meet before the prefill answers: the decode worker names the
hold itself (`kvyard.stream_id` in the prefill leg's `kv_transfer_params`, a
uuid4: the same unguessable capability the prefill worker's own request ids
are) and opens the pull at the same time as the leg, at the peer endpoint the
prefill worker publishes on `/health` (`kv_peer`: engine id, port, shm),
learned once per target and kept. The prefill worker waits a little
(`STREAM_WAIT_S`) for a named hold to be opened (the pull may arrive before the
leg is admitted), claims it, and sends each range of blocks as the engine
publishes them (kv_holds.py). The pull goes to the signed target's host only, as
the offer's does. Anything before the claim (no endpoint, another engine, no
such hold in time) is `NotClaimed`: the decode worker then pulls from the offer
as without streaming. After it, a failure is a `PeerError` and a fallback, as for
any pull.

Wire (peer_wire messages; TCP: one connection per pull; same host: the
SOCK_SEQPACKET socket and buffer of peer_shm.py):
  decode -> prefill: {"remote_engine_id", "remote_request_id": stream id,
                      "num_blocks": n (what it wants, at most), "stream": true}
                     (same host: + its buffer's descriptor, n frames)
  prefill -> decode: {"ok": true, "stream": true, "num_blocks": n, "block_bytes": b},
                     then per range {"blocks": [s, e], "hashes": [...], "growing": g}
                     followed (TCP) by frames s..e, or (same host) by {"ready": e} once
                     they are written at frame s of the buffer; then {"end": true,
                     "num_blocks": total};
                     or {"ok": false, "error", "reason"} instead of a range.
`growing` says the prefill still ran when the range was sent. The decode worker
keeps the leading blocks whose hashes are its own tokenization's (a range whose
hash differs ends the pull there) and verifies every frame as in any pull.
"""
from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.kvstore.layout import Namespace

from . import peer_shm
from .peer_wire import (HEAD_BYTES, PeerError, check_head, message, parse_body,
                        recv_all_into, verified_frame)
from .shm_pool import ShmPool

STREAM_WAIT_S = 10.0      # the prefill side's wait for a named hold to be opened
RANGE_BLOCKS = 64         # at most this many blocks per range (its hashes fit a message)


class NotClaimed(Exception):
    """The stream claimed nothing: the offer's pull may still take the hold. `reason`:
    "unreachable" (no endpoint there), or the prefill worker's refusal ("unknown_engine":
    another process now; "unknown_request": no such hold in time)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class PeerInfo:
    """A prefill worker's peer endpoint, as its /health publishes it."""

    engine_id: str
    port: int
    shm: bool

    @classmethod
    def from_health(cls, doc: Any) -> "PeerInfo | None":
        p = doc.get("kv_peer") if isinstance(doc, dict) else None
        if not isinstance(p, dict):
            return None
        try:
            info = cls(str(p["engine_id"]), int(p["port"]), p.get("shm") is True)
        except (KeyError, TypeError, ValueError):
            return None
        return info if 0 < info.port < 65536 else None


@dataclass(slots=True)
class Streamed:
    payloads: list[memoryview]
    early: int                 # blocks sent while the prefill still ran
    tail_s: float              # from the prompt's last range announced to its blocks verified
    transport: str


# ---------------------------------------------------------------- prefill side
def ranges(wait: Callable[[Any, int, float], tuple[int, bool]], hold: Any, n: int,
           timeout_s: float) -> Iterator[tuple[int, int, bool]]:
    """(start, end, growing) of the hold's first `n` blocks as they are published;
    ends when the hold is complete or has `n`. PeerError if its request fails or no
    block comes within `timeout_s`."""
    sent = 0
    while sent < n:
        try:
            have, growing = wait(hold, sent, timeout_s)
        except TimeoutError as e:
            raise PeerError("prefill_timeout", str(e)) from None
        except RuntimeError as e:
            raise PeerError("prefill_failed", str(e)) from None
        have = min(have, n)
        if have <= sent:
            return
        while sent < have:
            end = min(sent + RANGE_BLOCKS, have)
            yield sent, end, growing
            sent = end


def range_message(hold: Any, s: int, e: int, growing: bool) -> bytes:
    return message({"blocks": [s, e], "growing": growing,
                    "hashes": [f"{h:032x}" for h in hold.block_hashes[s:e]]})


# ---------------------------------------------------------------- decode side
async def stream_tcp(host: str, info: PeerInfo, stream_id: str, namespace: Namespace,
                     own: list[int], timeout_s: float, executor: Executor) -> Streamed:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, info.port)), 5.0)
        except (OSError, TimeoutError) as e:
            raise NotClaimed("unreachable", f"peer endpoint {host}:{info.port}: {e}") from None
        await loop.sock_sendall(sock, _request(info, stream_id, len(own)))
        sock.setblocking(True)
        return await _bounded(loop, executor, sock, timeout_s, _receive, sock, None,
                              namespace, own, "tcp")
    finally:
        sock.close()


async def stream_shm(info: PeerInfo, stream_id: str, namespace: Namespace, own: list[int],
                     timeout_s: float, pool: ShmPool, executor: Executor) -> Streamed:
    """peer_shm.ShmUnavailable when there is no same-host endpoint for `info`."""
    loop = asyncio.get_running_loop()
    sock = await peer_shm.connect(info.engine_id)
    try:
        frame = HEADER_BYTES + namespace.layout.nbytes
        buf, view = await loop.run_in_executor(executor, pool.take, info.engine_id,
                                               len(own) * frame)
        ok = False
        try:
            socket.send_fds(sock, [_request(info, stream_id, len(own))], [buf.fd])
            sock.setblocking(True)
            out = await _bounded(loop, executor, sock, timeout_s, _receive, sock, view,
                                 namespace, own, "shm")
            ok = True
            return out
        finally:
            if not ok:
                pool.drop(buf)   # its peer may still write it: never reused
    finally:
        sock.close()


def _request(info: PeerInfo, stream_id: str, n: int) -> bytes:
    return message({"remote_engine_id": info.engine_id, "remote_request_id": stream_id,
                    "num_blocks": n, "stream": True})


async def _bounded(loop: asyncio.AbstractEventLoop, executor: Executor, sock: socket.socket,
                   timeout_s: float, fn: Callable[..., Streamed], *args: Any) -> Streamed:
    """`fn` in a thread, at most `timeout_s`: past it (or cancelled) the socket is shut,
    which ends the thread's blocking receive, and the thread is waited for."""
    fut = loop.run_in_executor(executor, fn, *args)
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except TimeoutError:
        raise PeerError("transfer_timeout", f"streamed pull took over {timeout_s}s") from None
    except (asyncio.IncompleteReadError, ConnectionError):
        raise PeerError("transfer_truncated", "streamed transfer ended early") from None
    except OSError as e:
        raise PeerError("transfer_failed", f"streamed transfer: {e}") from None
    finally:
        if not fut.done():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            await asyncio.gather(fut, return_exceptions=True)


def _receive(sock: socket.socket, view: Any, namespace: Namespace, own: list[int],
             transport: str) -> Streamed:
    """In a thread: the ok, then each range verified as it comes (TCP: its frames read
    into one buffer after its header; same host: already in `view`)."""
    recv = peer_shm.recv_packet if view is not None else _recv_message
    head = recv(sock)
    if head.get("ok") is not True or head.get("stream") is not True:
        raise NotClaimed(str(head.get("reason") or "refused"),
                         f"peer refused the stream: {head.get('error')}")
    lay = namespace.layout
    n = head.get("num_blocks")
    if head.get("block_bytes") != lay.nbytes or not isinstance(n, int) \
            or not 0 < n <= len(own):
        raise PeerError("kv_mismatch", f"peer streams {n} blocks of "
                        f"{head.get('block_bytes')} bytes, expected {lay.nbytes}")
    frame = HEADER_BYTES + lay.nbytes
    mem = memoryview(np.empty(n * frame, dtype=np.uint8) if view is None else view).cast("B")
    out: list[memoryview] = []
    early, t_end = 0, None
    while True:
        msg = recv(sock)
        growing = msg.get("growing") is True
        if t_end is None and not growing:
            t_end = time.perf_counter()
        if msg.get("end") is True:
            if msg.get("num_blocks") != len(out):
                raise PeerError("transfer_corrupt", f"stream ended at {msg.get('num_blocks')}"
                                f" blocks, {len(out)} received")
            break
        if msg.get("ok") is False:
            raise PeerError(str(msg.get("reason") or "transfer_refused"),
                            f"peer: {msg.get('error')}")
        s, e, hashes = _range(msg, len(out), n)
        if view is None:
            recv_all_into(sock, mem[s * frame:e * frame])
        elif recv(sock).get("ready") != e:
            raise PeerError("transfer_corrupt", f"range {s}..{e} was not reported written")
        for i in range(s, e):
            if hashes[i - s] != own[i]:     # another tokenization from here on
                if not out:
                    raise PeerError("kv_mismatch", "no streamed block matches this prompt")
                return Streamed(out, early, 0.0, transport)
            out.append(verified_frame(mem, i, frame, namespace, own[i]))
        if growing:
            early += e - s
    if not out:
        raise PeerError("kv_mismatch", "the stream held no block")
    return Streamed(out, early, time.perf_counter() - (t_end or time.perf_counter()), transport)


def _range(msg: dict[str, Any], have: int, n: int) -> tuple[int, int, list[int]]:
    try:
        s, e = (int(x) for x in msg["blocks"])
        hashes = [int(h, 16) for h in msg["hashes"]]
    except (KeyError, TypeError, ValueError):
        raise PeerError("transfer_corrupt", f"bad range {str(msg)[:120]}") from None
    if s != have or not s < e <= n or len(hashes) != e - s:
        raise PeerError("transfer_corrupt", f"range {s}..{e} after {have} of {n} blocks")
    return s, e, hashes


def _recv_message(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(HEAD_BYTES)
    recv_all_into(sock, memoryview(head))
    body = bytearray(check_head(bytes(head)))
    recv_all_into(sock, memoryview(body))
    return parse_body(bytes(body))
