"""The benches' one streaming client and one percentile: vLLM `bench serve`'s TTFT, TPOT
and ITL from chunk arrival times, and numpy's default (linear) percentile."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from aiohttp import web

from kvyard.bench.client import StreamClock, chat_body, completion_body, stream
from kvyard.bench.report import percentile


def completion(text: str | None, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat(content: str | None = None, role: bool = False) -> dict:
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta}]}


def usage(n: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}


def test_completion_metrics_follow_vllm() -> None:
    c = StreamClock(sent=10.0)
    c.chunk(10.5, completion("a"))
    c.chunk(10.7, completion("b"))
    c.chunk(10.8, completion(""))        # no text: not a token-bearing chunk
    c.chunk(11.1, completion("cd"))      # two tokens in one chunk: one gap
    c.chunk(11.2, completion(None, "length"))
    c.chunk(11.2, usage(4))
    r = c.result(end=11.5)
    assert r.ok and r.text == "abcd" and r.num_tokens == 4
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.2, 0.4])
    assert r.latency_s == pytest.approx(1.5)
    assert r.tpot_s == pytest.approx((1.5 - 0.5) / 3)   # (latency - TTFT) / (tokens - 1)


def test_chat_role_chunk_is_not_the_first_token_and_chunks_count_without_usage() -> None:
    c = StreamClock(sent=0.0)
    c.chunk(0.1, chat(role=True, content=""))
    c.chunk(0.3, chat("Hi"))
    c.chunk(0.4, chat(" there"))
    r = c.result(end=0.5)
    assert r.ttft_s == pytest.approx(0.3) and r.num_tokens == 2 and r.text == "Hi there"
    assert r.tpot_s == pytest.approx(0.2)


def test_one_token_no_token_and_errors() -> None:
    one = StreamClock(sent=0.0)
    one.chunk(0.2, completion("x"))
    assert math.isnan(one.result(end=0.3).tpot_s) and one.result(end=0.3).ok
    assert StreamClock(sent=0.0).result(end=1.0).error == "no tokens streamed"
    bad = StreamClock(sent=0.0)
    bad.chunk(0.1, completion("x"))
    bad.chunk(0.2, {"error": {"message": "boom", "code": 500}})
    r = bad.result(end=0.3)
    assert not r.ok and "boom" in r.error and math.isnan(r.ttft_s)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_is_numpys_default(q: float) -> None:
    rng = np.random.default_rng(int(q * 10))
    for n in (1, 2, 5, 101):
        xs = rng.random(n).tolist()
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)
    assert math.isnan(percentile([], q))


async def test_stream_against_a_server() -> None:
    """The path follows the body; HTTP errors are results, not exceptions."""
    import aiohttp

    seen: list[tuple[str, dict]] = []

    async def sse(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((request.path, body))
        if body.get("max_tokens") == 0:
            return web.json_response({"error": {"message": "max_tokens"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunks = [chat(role=True, content=""), chat("o"), chat("k")] if "messages" in body \
            else [completion("o"), completion("k")]
        for msg in [*chunks, usage(2)]:
            await resp.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", sse)
    app.router.add_post("/v1/chat/completions", sse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            a = await stream(s, url, completion_body(None, [1, 2, 3], 2))
            b = await stream(s, url, chat_body("m", "hi", 2))
            bad = await stream(s, url, completion_body("m", "hi", 0))
    finally:
        await runner.cleanup()
    assert (a.text, a.num_tokens, b.text, b.num_tokens) == ("ok", 2, "ok", 2)
    assert [p for p, _ in seen] == ["/v1/completions", "/v1/chat/completions", "/v1/completions"]
    assert "model" not in seen[0][1] and seen[0][1]["stream_options"] == {"include_usage": True}
    assert not bad.ok and bad.error.startswith("HTTP 400")
