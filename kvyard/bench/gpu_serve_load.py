"""One concurrency level of closed-loop streaming load against a worker (the GPU serve benches').

`c` streams each send streaming `/v1/completions` requests back to back: one warm-up request per
stream (not counted), then `per_stream` timed ones. Per request: TTFT and TPOT as `bench.client`
defines them (vLLM's `bench serve`'s); per level p50/p99 in seconds and output tokens/s over the
level's wall time. With a deadline, streams send nothing new once it has passed and requests still
in flight `grace_s` later are cancelled (the worker aborts them); the level then reports what
finished and `truncated`, so a time-boxed run ends cleanly with what it has.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvyard.bench.client import RequestResult, completion_body, stream
from kvyard.bench.report import percentile


@dataclass(slots=True)
class Prompts:
    """Seeded random token-id prompts of `length` tokens from ids 4..vocab-1, each one random
    `segment` of tokens repeated (segment 0: no repetition), so n-gram speculation finds its
    proposals in the prompt; every prompt is fresh (no prefix-cache hits across requests)."""

    vocab: int
    length: int
    segment: int = 0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def __call__(self) -> list[int]:
        n = self.segment if 0 < self.segment < self.length else self.length
        seg = [self._rng.randrange(4, self.vocab) for _ in range(n)]
        return (seg * (self.length // n + 1))[:self.length]


@dataclass(slots=True)
class Load:
    url: str
    concurrency: int
    per_stream: int
    new_tokens: int
    prompts: Callable[[], list[int]]
    model_for: Callable[[int], str | None] = lambda i: None   # request index -> `model` (None: the server's)
    deadline: float = math.inf       # time.monotonic() after which no request starts
    grace_s: float = 30.0            # then in-flight requests get this long before they are cancelled


async def _one(session: Any, load: Load, i: int) -> RequestResult:
    r = await stream(session, load.url, completion_body(load.model_for(i), load.prompts(), load.new_tokens))
    if r.error is not None:
        raise RuntimeError(r.error)
    if r.num_tokens != load.new_tokens:
        raise RuntimeError(f"stream ended with {r.num_tokens} tokens of {load.new_tokens}")
    return r


async def run_level(load: Load) -> dict[str, Any]:
    """The level's numbers: tok_s, ttft_p50/p99 and tpot_p50/p99 (seconds), requests, wall_s,
    truncated. A failed request raises (RuntimeError with the server's answer)."""
    import aiohttp

    c = load.concurrency
    results: list[RequestResult] = []
    counter = itertools.count()

    async def closed_loop(s: Any, n: int, sink: list[RequestResult]) -> None:
        for _ in range(n):
            if time.monotonic() >= load.deadline:
                return
            sink.append(await _one(s, load, next(counter)))

    async def bounded(coro: Any) -> bool:
        """False when the deadline's grace ran out and the level was cut."""
        left = load.deadline + load.grace_s - time.monotonic()
        try:
            await asyncio.wait_for(coro, timeout=None if math.isinf(left) else max(left, 0.0))
            return True
        except asyncio.TimeoutError:
            return False

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        warm: list[RequestResult] = []
        complete = await bounded(asyncio.gather(*(closed_loop(s, 1, warm) for _ in range(c))))
        t0 = time.perf_counter()
        if complete:
            complete = await bounded(asyncio.gather(*(closed_loop(s, load.per_stream, results) for _ in range(c))))
        wall = time.perf_counter() - t0
    ttft = [r.ttft_s for r in results]
    tpot = [r.tpot_s for r in results if not math.isnan(r.tpot_s)]
    return dict(concurrency=c, requests=len(results), wall_s=wall,
                truncated=not complete or len(results) < c * load.per_stream,
                tok_s=sum(r.num_tokens for r in results) / wall if results else 0.0,
                ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),   # nan: none finished
                tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99))
