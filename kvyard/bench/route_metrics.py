"""What `kvyard bench route` reads off the pods and what it reports per policy.

Pods are read through their vLLM `/metrics`: prefix-cache hits and queries
(tokens) summed over the pool give the pool hit rate; requests finished per pod
give the load imbalance (max / mean). A pod without `vllm:request_success_total`
(the stand-in worker) is asked `/standin/stats` instead.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp

from kvyard.bench.client import RequestResult
from kvyard.bench.report import percentile
from kvyard.common.wire import M_REQUEST_SUCCESS
from kvyard.epp.pool.metrics_parse import parse_vllm_metrics

KEYS = ("throughput_tok_s", "goodput", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p99", "errors",
        "hit_rate", "ideal_hit_rate", "imbalance", "shed")


@dataclass(slots=True)
class PodCounters:
    hits: float = 0.0
    queries: float = 0.0
    finished: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None


def parse_counters(text: str) -> PodCounters:
    """Sums each counter over its label sets; reads the cache size from cache_config_info
    (the EPP's own parser, so the bench reads pods exactly as the EPP does)."""
    m = parse_vllm_metrics(text)
    return PodCounters(m.prefix_hits or 0.0, m.prefix_queries or 0.0, m.finished or 0.0,
                       m.num_gpu_blocks, m.block_size)


async def _one(session: aiohttp.ClientSession, address: str) -> PodCounters:
    async with session.get(f"http://{address}/metrics") as r:
        text = await r.text()
    c = parse_counters(text)
    if M_REQUEST_SUCCESS not in text:
        async with session.get(f"http://{address}/standin/stats") as r:
            if r.status == 200:
                c.finished = float((await r.json())["served"])
    return c


async def scrape(addresses: Sequence[str]) -> list[PodCounters]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        return list(await asyncio.gather(*(_one(s, a) for a in addresses)))


def pool_delta(before: list[PodCounters], after: list[PodCounters]) -> tuple[float, float]:
    """(pool hit rate, imbalance) between two scrapes of the same pods."""
    hits = sum(a.hits - b.hits for a, b in zip(after, before))
    queries = sum(a.queries - b.queries for a, b in zip(after, before))
    counts = [a.finished - b.finished for a, b in zip(after, before)]
    mean = sum(counts) / len(counts) if counts else 0.0
    return (hits / queries if queries > 0 else 0.0,
            max(counts) / mean if mean > 0 else math.nan)


@dataclass(slots=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def met(self, r: RequestResult) -> bool:
        return r.ok and r.ttft_s <= self.ttft_s and (math.isnan(r.tpot_s) or r.tpot_s <= self.tpot_s)


@dataclass(slots=True)
class RungResult:
    """One policy at one rate: the client's view plus the pods'."""

    rate: float
    results: list[RequestResult]
    wall_s: float
    hit_rate: float = 0.0
    imbalance: float = math.nan
    ideal_hit_rate: float = 0.0
    extra: dict = field(default_factory=dict)

    def summary(self, slo: Slo) -> dict:
        ok = [r for r in self.results if r.ok]
        shed = sum(1 for r in self.results if r.error and r.error.startswith(("HTTP 429",
                                                                                "HTTP 503")))
        ttft = [r.ttft_s for r in ok]
        tpot = [r.tpot_s for r in ok if not math.isnan(r.tpot_s)]
        wall = max(self.wall_s, 1e-9)
        return {"rate": self.rate,
                "throughput_tok_s": sum(r.num_tokens for r in ok) / wall,
                "goodput": sum(1 for r in self.results if slo.met(r)) / wall,
                "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90),
                "ttft_p99": percentile(ttft, 99), "tpot_p99": percentile(tpot, 99),
                "errors": len(self.results) - len(ok) - shed, "hit_rate": self.hit_rate,
                "ideal_hit_rate": self.ideal_hit_rate, "imbalance": self.imbalance,
                "shed": shed, "requests": len(self.results), **self.extra}
