"""One kept-alive HTTP/1.1 connection per endpoint, for `GET /metrics` only.

Why not aiohttp's client: a scrape is one small GET, and aiohttp spends most of a
scrape's CPU in its generic request/response machinery (a request object, headers
multidicts, a response object, a stream reader); at hundreds of endpoints that was
most of an idle EPP's CPU. This protocol writes one prebuilt request and parses the
status line, Content-Length or chunked framing, and nothing else.

A connection also tells when the endpoint goes away: the peer's process dying closes
the socket, and `on_lost` fires at once (the scraper then scrapes that endpoint at
its next round instead of waiting for its idle cadence, so a dead worker that was idle
is still marked down within a fraction of a second).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

_MAX_HEAD = 64 * 1024
_MAX_BODY = 16 * 1024 * 1024  # far above any exposition; a bound against a hostile peer


class HttpError(Exception):
    """The peer answered with something that is not an HTTP/1.x response we can read."""


class Unreachable(Exception):
    """No connection could be opened (refused, no route, no such host): the process is gone."""


@dataclass(slots=True)
class _Response:
    status: int = 0
    length: int | None = None  # Content-Length; None: chunked or until close
    chunked: bool = False
    close: bool = False  # the peer said Connection: close (or HTTP/1.0)


def _parse_head(head: bytes) -> _Response:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"bad status line {lines[0][:80]!r}")
    r = _Response(status=int(parts[1]), close=parts[0] == b"HTTP/1.0")
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            if not value.isdigit():
                raise HttpError(f"bad Content-Length {value[:20]!r}")
            r.length = int(value)
        elif name == b"transfer-encoding":
            r.chunked = value.endswith(b"chunked")
        elif name == b"connection":
            r.close = value == b"close" or (r.close and value != b"keep-alive")
    if r.chunked:
        r.length = None
    return r


def _dechunk(buf: bytearray) -> tuple[bytes, int] | None:
    """(body, bytes used) once the whole chunked body is in `buf`, else None."""
    out, pos = bytearray(), 0
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpError(f"bad chunk size {size_text[:20]!r}") from None
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", pos - 2)  # no trailers: "0\r\n\r\n"
            return (bytes(out), end + 4) if end >= 0 else None
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos:pos + size]
        pos += size + 2
        if len(out) > _MAX_BODY:
            raise HttpError("body too large")


class MetricsConnection(asyncio.Protocol):
    """`await get(timeout)` -> (status, body); one request at a time."""

    def __init__(self, address: str, path: str = "/metrics",
                 on_lost: Callable[[], None] | None = None) -> None:
        self.address = address
        self._request = (f"GET {path} HTTP/1.1\r\nHost: {address}\r\n"
                         "Accept: text/plain\r\nUser-Agent: kvyard-epp\r\n\r\n").encode()
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._head: _Response | None = None
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    @classmethod
    async def open(cls, address: str, timeout: float,
                   on_lost: Callable[[], None] | None = None) -> "MetricsConnection":
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        conn = cls(address, on_lost=on_lost)
        await asyncio.wait_for(loop.create_connection(lambda: conn, host.strip("[]"), int(port)),
                               timeout)
        return conn

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            self.close()  # unsolicited bytes: the stream is out of step
            return
        self._buf += data
        try:
            done = self._parse()
        except HttpError as e:
            self._fail(e)
            return
        if done is not None:
            w, self._waiter = self._waiter, None
            self._cancel_timer()
            if self._head is not None and self._head.close:
                self.close()
            self._head = None
            if not w.done():
                w.set_result(done)

    def eof_received(self) -> bool | None:
        if self._waiter is not None and self._head is not None and self._head.length is None \
                and not self._head.chunked:  # a body delimited by the close
            self.closed = True  # an expected close: not the endpoint going away
            w, self._waiter = self._waiter, None
            self._cancel_timer()
            if not w.done():
                w.set_result((self._head.status, bytes(self._buf)))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        was_closed, self.closed = self.closed, True
        self._cancel_timer()
        if self._waiter is not None:
            w, self._waiter = self._waiter, None
            if not w.done():
                w.set_exception(ConnectionResetError(f"{self.address} closed the connection"))
        elif not was_closed and self._on_lost is not None:
            self._on_lost()

    # client side
    async def get(self, timeout: float) -> tuple[int, bytes]:
        if self.closed or self._transport is None or self._waiter is not None:
            raise ConnectionResetError(f"connection to {self.address} is not usable")
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._timer = loop.call_later(timeout, self._timed_out)
        self._transport.write(self._request)
        return await self._waiter

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._transport is not None:
                self._transport.close()

    def _parse(self) -> tuple[int, bytes] | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise HttpError("response head too large")
                return None
            self._head = _parse_head(bytes(buf[:end]))
            del buf[:end + 4]
        h = self._head
        if h.chunked:
            got = _dechunk(buf)
            if got is None:
                return None
            body, used = got
            del buf[:used]
            return h.status, body
        if h.length is None:  # until the peer closes (eof_received)
            if len(buf) > _MAX_BODY:
                raise HttpError("body too large")
            return None
        if h.length > _MAX_BODY:
            raise HttpError("body too large")
        if len(buf) < h.length:
            return None
        body = bytes(buf[:h.length])
        del buf[:h.length]
        return h.status, body

    def _timed_out(self) -> None:
        self._timer = None
        self._fail(asyncio.TimeoutError(f"no answer from {self.address} in time"))

    def _fail(self, exc: BaseException) -> None:
        w, self._waiter = self._waiter, None
        self._cancel_timer()
        self.closed = True
        if self._transport is not None:
            self._transport.abort()
        if w is not None and not w.done():
            w.set_exception(exc)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


@dataclass(slots=True)
class ConnectionPool:
    """The scraper's connections, one per endpoint address, opened on first use."""

    connect_timeout: float
    on_lost: Callable[[str], None] | None = None
    _conns: dict[str, MetricsConnection] = field(default_factory=dict)

    async def get(self, address: str, timeout: float) -> tuple[int, bytes]:
        conn = self._conns.get(address)
        if conn is None or conn.closed:
            lost = None if self.on_lost is None else (lambda a=address: self.on_lost(a))
            try:
                conn = await MetricsConnection.open(address, min(timeout, self.connect_timeout),
                                                    lost)
            except TimeoutError:
                raise  # a slow connect is a hung endpoint, not a gone one
            except OSError as e:
                raise Unreachable(str(e)) from e
            self._conns[address] = conn
        return await conn.get(timeout)

    def keep_only(self, addresses: set[str]) -> None:
        for addr in [a for a in self._conns if a not in addresses]:
            self._conns.pop(addr).close()

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()
