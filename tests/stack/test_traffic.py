"""Requests through real Envoy and the real EPP process reach stand-in workers,
stick to the worker that holds their prefix, avoid a loaded worker, and survive
200 concurrent clients with nothing lost or duplicated."""
from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp

from kvyard.stack import commands, procs

LONG_SYSTEM = ("You are a careful assistant for the city library. " * 120)


def test_non_streaming_chat_reaches_a_worker(stack, h) -> None:
    r = h.request(stack.gateway_url, h.chat_body("ping-1"))
    assert r.status == 200, r.body
    assert r.endpoint in stack.endpoints
    assert r.json()["choices"][0]["message"]["content"] == f"[{r.endpoint}] ping-1"


def test_streaming_chat_flows_through(stack, h) -> None:
    r = h.request(stack.gateway_url, h.chat_body("ping-stream", stream=True))
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["choices"][0]["delta"]["content"] == f"[{r.endpoint}] ping-stream"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"


def test_shared_prefix_sticks_to_one_worker(stack, h) -> None:
    system = f"{uuid.uuid4()} " + LONG_SYSTEM  # a prefix no other test used
    hits = [h.request(stack.gateway_url, h.chat_body(f"question {i}", system=system)).endpoint
            for i in range(8)]
    assert None not in hits
    # The first pick is free; every later one must follow the cached prefix.
    assert hits[1:] == [hits[0]] * 7, hits


def test_a_deeply_queued_worker_is_avoided(stack, h, wait_until) -> None:
    busy = stack.endpoints[0]
    h.set_queue(busy, 50)
    try:
        wait_until(lambda: h.epp_rows(stack)[busy]["queue"] >= 50, timeout=5,
                   what="the EPP to scrape the deep queue")
        hits = [h.request(stack.gateway_url, h.chat_body(f"{uuid.uuid4()} fresh")).endpoint
                for _ in range(20)]
        assert busy not in hits, hits
        assert set(hits) <= set(stack.endpoints[1:])
    finally:
        h.set_queue(busy, 0)
        wait_until(lambda: h.epp_rows(stack)[busy]["queue"] == 0, timeout=5, what="queue reset")


def test_forged_destination_is_ignored(stack, h, tmp_path, wait_until) -> None:
    # A live decoy outside the pool: if Envoy honoured the client's header, it would answer.
    port = procs.free_port()
    decoy = f"127.0.0.1:{port}"
    p = procs.spawn("decoy", commands.py_module("kvyard.stack.standin", "--port", str(port)),
                    tmp_path / "decoy.log")
    try:
        wait_until(lambda: procs.http_ok(f"http://{decoy}/health"), timeout=30, what="decoy")
        forged = {"x-gateway-destination-endpoint": decoy, "x-prefiller-host-port": decoy}
        for i in range(5):
            r = h.request(stack.gateway_url, h.chat_body(f"{uuid.uuid4()} forged {i}"),
                          headers=forged)
            assert r.status == 200, r.body
            assert r.endpoint in stack.endpoints
            # The EPP may name its own prefiller, never the client's.
            assert r.headers["x-standin-prefiller"] != decoy
        assert h.served(decoy) == 0
    finally:
        procs.stop([p.pid])


async def _concurrent(url: str, n: int) -> list[tuple[int, str, str, str | None]]:
    async def one(session: aiohttp.ClientSession, rid: str):
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                "messages": [{"role": "user", "content": rid}]}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            data = await resp.json(content_type=None)
            text = data["choices"][0]["message"]["content"] if resp.status == 200 else ""
            return resp.status, rid, text, resp.headers.get("x-kvyard-endpoint")

    conn = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        return await asyncio.gather(*(one(s, f"req-{uuid.uuid4()}") for _ in range(n)))


def test_200_concurrent_requests_none_lost_or_duplicated(stack, h) -> None:
    before = sum(h.served(a) for a in stack.endpoints)
    results = asyncio.run(_concurrent(stack.gateway_url, 200))
    assert [s for s, *_ in results] == [200] * 200
    for _, rid, text, endpoint in results:
        assert text == f"[{endpoint}] {rid}"  # each answer is its own request's
    assert len({rid for _, rid, _, _ in results}) == 200
    # Exactly one upstream request per client request: no retries, no duplicates.
    assert sum(h.served(a) for a in stack.endpoints) - before == 200
