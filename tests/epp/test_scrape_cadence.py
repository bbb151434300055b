"""The scraper's kept-alive HTTP client and its idle cadence, against real servers."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from kvyard.epp.pool.metrics_conn import ConnectionPool, HttpError, MetricsConnection, Unreachable


async def _raw_server(free_port, replies: list[bytes], close_after: bool = False):
    """A TCP server that answers each request with the next raw reply, then keeps the
    connection open (or closes it): the framings aiohttp would never produce."""
    seen: list[bytes] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while replies:
                head = await r.readuntil(b"\r\n\r\n")
                seen.append(head)
                w.write(replies.pop(0))
                await w.drain()
            if not close_after:
                await r.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return server, f"127.0.0.1:{port}", seen


async def test_reads_length_chunked_and_close_framed_bodies(free_port):
    body = b"vllm:num_requests_waiting 3\n"
    replies = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nvllm:\r\n17;ext=1\r\nnum_requests_waiting 3\n\r\n0\r\n\r\n",
               b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n"]
    server, addr, seen = await _raw_server(free_port, replies)
    try:
        conn = await MetricsConnection.open(addr, 1.0)
        assert await conn.get(1.0) == (200, body)
        assert await conn.get(1.0) == (200, body)  # the same connection: kept alive
        assert (await conn.get(1.0))[0] == 503
        assert len(seen) == 3 and seen[0].startswith(b"GET /metrics HTTP/1.1\r\n")
        conn.close()
    finally:
        server.close()

    # no length: the body ends where the peer closes
    server, addr, _ = await _raw_server(free_port, [b"HTTP/1.0 200 OK\r\n\r\n" + body],
                                        close_after=True)
    try:
        conn = await MetricsConnection.open(addr, 1.0)
        assert await conn.get(1.0) == (200, body)
    finally:
        server.close()


async def test_garbage_timeouts_and_refusals_are_errors(free_port):
    server, addr, _ = await _raw_server(free_port, [b"SSH-2.0-OpenSSH\r\n\r\n"])
    try:
        conn = await MetricsConnection.open(addr, 1.0)
        with pytest.raises(HttpError):
            await conn.get(1.0)
        assert conn.closed
    finally:
        server.close()
    server, addr, _ = await _raw_server(free_port, [])  # accepts, never answers
    try:
        conn = await MetricsConnection.open(addr, 1.0)
        with pytest.raises(asyncio.TimeoutError):
            await conn.get(0.2)
    finally:
        server.close()
    pool = ConnectionPool(0.5)
    with pytest.raises(Unreachable):
        await pool.get(f"127.0.0.1:{free_port()}", 0.5)  # nothing listens there


async def test_idle_endpoints_are_scraped_slowly_busy_ones_fast(fake_vllm, epp, xp):
    idle, busy = await fake_vllm(), await fake_vllm(running=2)
    app = await epp([idle, busy], scrape_interval=0.02, scrape_idle_interval=0.5)
    await xp.wait_for(lambda: app.scraper.rounds > 3 and busy.scrapes > 3, what="scrapes")
    i0, b0 = idle.scrapes, busy.scrapes
    await xp.wait_for(lambda: busy.scrapes >= b0 + 20, what="busy endpoint scraped")
    assert idle.scrapes - i0 <= 3  # ~0.4 s at 20 ms a round: 20 rounds, at most ~1 idle scrape
    # a pick (pending) makes an idle endpoint busy at once: its next scrape is a round away
    e = app.pool.get(idle.address)
    i1 = idle.scrapes
    idle.waiting = 4
    e.pending += 1
    await xp.wait_for(lambda: e.waiting == 4, timeout=0.4, what="picked endpoint rescraped")
    assert idle.scrapes - i1 >= 1
    # and it stays fast while it is busy
    i2 = idle.scrapes
    await xp.wait_for(lambda: idle.scrapes >= i2 + 5, timeout=1.0, what="busy cadence")


async def test_idle_endpoint_that_dies_is_down_at_once(fake_vllm, epp, xp):
    w1, w2 = await fake_vllm(), await fake_vllm()
    # a long idle cadence: only the closed connection can tell the scraper in time
    app = await epp([w1, w2], scrape_idle_interval=5.0, stale_after=20.0)
    e1 = app.pool.get(w1.address)
    await xp.wait_for(lambda: e1.last_ok > 0 and app.scraper.idle(e1), what="idle")
    await asyncio.sleep(0)  # the scrape just started, if any, completes
    await w1.stop()
    await xp.wait_for(lambda: e1.down, timeout=2.0, what="closed connection noticed")
    assert "unreachable" in e1.last_error
    await w1.start()
    await xp.wait_for(lambda: not e1.down, timeout=3.0, what="back")
