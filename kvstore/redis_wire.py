"""Redis wire I/O below redis-py's command API, for the block tier's two hot paths.

Why: redis-py's convenience layers copy every value (hiredis packing copies a
SET's value twice; an MGET reply becomes bytes objects that the store then
copies again). These functions use a redis-py connection's socket directly:
SETs go out uncopied, one sendmsg per value; MGET values are read from the
socket into the caller's buffers and verified there. Connections are always
released, and dropped when a reply may be half read.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import redis
from redis._parsers import Encoder
from redis.connection import PythonRespSerializer

from kvyard.kvstore.codec import HEADER_BYTES, CorruptBlock, check_header, decode
from kvyard.kvstore.layout import KVLayout


def zero_copy_packer() -> PythonRespSerializer:
    """redis-py's pure-Python RESP packer, which sends a memoryview argument as a
    chunk of its own, uncopied. Once hiredis is installed redis-py packs with
    hiredis instead, which copies every value twice (`bytes()`, then
    `pack_command`), several times slower for block-sized SETs. Replies still
    parse with hiredis, faster than the Python parser for MGETs (both measured:
    see docs/benchmarks.md, kvstore)."""
    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def set_head(rkey: bytes, nbytes: int, ttl_s: int | None) -> tuple[bytes, bytes]:
    """RESP for `SET rkey <value of nbytes> [EX ttl_s]`, less the value: (head, tail).
    Formatted directly: redis-py's packer costs microseconds a command, a few
    percent of a block-sized SET on loopback, where every per-value microsecond
    shows."""
    if ttl_s:
        ex = b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(int(ttl_s))), int(ttl_s))
        return (b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(rkey), rkey, nbytes),
                b"\r\n" + ex)
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(rkey), rkey, nbytes), b"\r\n"


def send_sets(client, rkeys: list[bytes], values, ttl_s: int | None) -> list:
    """Pipelined SETs on one connection of `client` (a node's, on a cluster): each
    value sent uncopied, with the previous command's tail and its own head in the
    same sendmsg (`_send_all`); `values` may be a generator that readies each
    value just before it goes out. Then every reply is read (an error raises)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        tail = b""
        for rk, v in zip(rkeys, values):
            head, nxt = set_head(rk, v.nbytes, ttl_s)
            if conn._sock is None:
                conn.connect()
            _send_all(conn._sock, [tail + head, v])
            tail = nxt
        if tail:
            conn.send_packed_command([tail], check_health=False)
        return [conn.read_response() for _ in rkeys]
    except BaseException:
        conn.disconnect()  # replies may be left unread: never reuse it
        raise
    finally:
        pool.release(conn)


def _send_all(sock, bufs: list) -> None:
    """Every byte of `bufs`, in order, through sendmsg: a SET's head (the previous
    command's tail, `*3 $3 SET $len key $len`) and its value go out in one syscall,
    uncopied, where redis-py's `send_packed_command` does a `sendall` per chunk,
    so with TCP_NODELAY every head would leave as a tiny segment of its own and
    wake the server once more per value. A partial send resumes where it stopped."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = sock.sendmsg(views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def mget_into(r, rkeys: list[bytes], keys: Sequence[bytes], dsts: Sequence[memoryview],
              layout: KVLayout, single_gets: bool = False) -> list:
    """One MGET on a connection of `r`; each full-length value is read from the
    socket straight into its dst (header into a small buffer) and verified
    there. Per key: True (placed), None (missing), a CorruptBlock, or the bytes
    of a value of unexpected length (the caller verifies those). Without
    hiredis, or with bytes already buffered in it, the ordinary reply is parsed
    and full-length values are verified and copied. `single_gets`: pipelined
    GETs instead (a cluster node, where one MGET may not span hash slots); their
    replies are the same values without the array header."""
    pool = r.connection_pool
    conn = pool.get_connection()
    try:
        if single_gets:
            conn.send_packed_command([b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)
                                               for k in rkeys)], check_health=False)
        else:
            conn.send_command("MGET", *rkeys, check_health=False)
        reader = getattr(conn._parser, "_reader", None)
        if reader is None or reader.has_data():  # not hiredis, or bytes buffered there
            vals = [conn.read_response() for _ in rkeys] if single_gets else conn.read_response()
            return [v if v is None or len(v) != HEADER_BYTES + layout.nbytes else
                    _place(v, k, d, layout) for v, k, d in zip(vals, keys, dsts)]
        sock = conn._sock
        pend = bytearray()

        def line() -> bytes:
            while (j := pend.find(b"\r\n")) < 0:
                got = sock.recv(16)  # small reads: at most a few bytes run ahead
                if not got:
                    raise redis.ConnectionError("connection closed by server")
                pend.extend(got)
            ln = bytes(pend[:j])
            del pend[:j + 2]
            return ln

        def read_into(mv: memoryview) -> None:
            k = min(len(pend), mv.nbytes)
            if k:
                mv[:k] = pend[:k]
                del pend[:k]
            while k < mv.nbytes:
                got = sock.recv_into(mv[k:])
                if not got:
                    raise redis.ConnectionError("connection closed by server")
                k += got

        if not single_gets:
            head = line()
            if head[:1] == b"-":
                raise redis.ResponseError(head[1:].decode(errors="replace"))
            if head[:1] != b"*" or int(head[1:]) != len(rkeys):
                raise redis.ConnectionError(f"unexpected MGET reply {head[:32]!r}")
        want = HEADER_BYTES + layout.nbytes
        out: list = []
        hdr = bytearray(HEADER_BYTES)
        for key, dst in zip(keys, dsts):
            ln = line()
            if ln == b"_":  # RESP3 null
                out.append(None)
                continue
            if ln[:1] == b"-":  # a GET's error (MOVED after a resharding, ...): the
                raise redis.ResponseError(ln[1:].decode(errors="replace"))  # conn is dropped
            if ln[:1] != b"$":
                raise redis.ConnectionError(f"unexpected MGET element {ln[:32]!r}")
            n = int(ln[1:])
            if n < 0:
                out.append(None)
                continue
            if n != want:
                buf = bytearray(n)
                read_into(memoryview(buf))
                out.append(bytes(buf))
            else:
                read_into(memoryview(hdr))
                read_into(dst)
                try:
                    check_header(hdr, key, layout, dst)
                    out.append(True)
                except CorruptBlock as e:
                    out.append(e)
            if line() != b"":
                raise redis.ConnectionError("MGET element not terminated")
        if pend:
            raise redis.ConnectionError("unexpected bytes after MGET reply")
        return out
    except BaseException:
        conn.disconnect()  # the reply may be half read: never reuse it
        raise
    finally:
        pool.release(conn)


def _place(value: bytes, key: bytes, dst: memoryview, layout: KVLayout):
    """A full-length value read the ordinary way: verified, then copied into dst."""
    try:
        payload = decode(value, key, layout)
    except CorruptBlock as e:
        return e
    np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
    return True
