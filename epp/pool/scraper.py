"""Keeps every endpoint's load metrics fresh by scraping `/metrics`.

One aiohttp session for all endpoints (keep-alive connections), one scrape
in flight per endpoint, all endpoints concurrently, a new round every
`interval`. Failure policy, chosen so a dead worker stops getting traffic in
well under a second without flapping on one slow scrape:

* connection refused / unreachable → `down` at once (the process is gone);
* other failures (timeout, HTTP error, not vLLM text) → `down` after
  `fail_threshold` in a row (3 × 0.3 s timeout < 1 s for a hung worker);
* metrics older than `stale_after` are deprioritised by the scheduler;
* the first good scrape brings an endpoint back.

`observers` see every good scrape's full parse (the KEDA scaler measures
capacity from its counters, `scaler/capacity.py`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from .endpoints import Endpoint, EndpointPool
from .metrics_parse import WorkerMetrics, parse_vllm_metrics

log = logging.getLogger("kvyard.epp.scraper")


@dataclass(slots=True)
class Scraper:
    pool: EndpointPool
    interval: float = 0.05
    timeout: float = 0.3
    fail_threshold: int = 3
    _session: aiohttp.ClientSession | None = None
    _inflight: dict[str, asyncio.Task] = field(default_factory=dict)
    rounds: int = 0
    observers: list[Callable[[Endpoint, WorkerMetrics, float], None]] = field(default_factory=list)
    on_scraped: Callable[[], None] | None = None  # after each good scrape (flow control)

    @property
    def running(self) -> bool:
        return self._session is not None

    async def scrape(self, ep: Endpoint) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"http://{ep.address}/metrics") as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                text = await r.text()
            m = parse_vllm_metrics(text)
            if m.seen == 0:
                raise ValueError("no vLLM metrics in the response")
        except aiohttp.ClientConnectorError as e:
            self._failed(ep, f"unreachable: {e.os_error or e}", immediate=True)
            return
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError) as e:
            self._failed(ep, f"{type(e).__name__}: {e}", immediate=False)
            return
        ep.waiting, ep.running, ep.kv_usage = m.waiting, m.running, m.kv_usage
        if m.sleeping != ep.sleeping:
            log.info("endpoint %s is %s", ep.address, "asleep" if m.sleeping else "awake")
        ep.sleeping = m.sleeping
        ep.prompt_tokens_pending = m.prompt_tokens_pending
        if m.lora_running is not None:
            ep.lora_running, ep.lora_waiting, ep.max_lora = (m.lora_running, m.lora_waiting,
                                                              m.max_lora)
        if m.block_size is not None:
            ep.block_size, ep.num_gpu_blocks = m.block_size, m.num_gpu_blocks
        if ep.down:
            log.info("endpoint %s is back", ep.address)
        now = time.monotonic()
        ep.last_ok, ep.failures, ep.down, ep.pending, ep.last_error = now, 0, False, 0, ""
        for fn in self.observers:
            try:
                fn(ep, m, now)
            except Exception:  # noqa: BLE001 - an observer's bug must not stop the scrapes
                log.exception("scrape observer %r failed", fn)
        if self.on_scraped is not None:
            self.on_scraped()

    def _failed(self, ep: Endpoint, why: str, immediate: bool) -> None:
        ep.failures += 1
        ep.last_error = why
        if not ep.down and (immediate or ep.failures >= self.fail_threshold):
            ep.down = True
            log.warning("endpoint %s is down: %s", ep.address, why)
            if self.on_scraped is not None:  # queued requests may now wait for a cold start
                self.on_scraped()

    def _done(self, addr: str, task: asyncio.Task) -> None:
        if self._inflight.get(addr) is task:
            del self._inflight[addr]

    def round(self) -> None:
        """Starts a scrape for every endpoint that has none in flight."""
        for ep in self.pool.all():
            if ep.address in self._inflight:
                continue
            t = asyncio.create_task(self.scrape(ep))
            self._inflight[ep.address] = t
            t.add_done_callback(lambda task, a=ep.address: self._done(a, task))
        self.rounds += 1

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
            self._session = s
            try:
                while True:
                    self.round()
                    await asyncio.sleep(self.interval)  # the scrape period, not a sync point
            finally:
                for t in list(self._inflight.values()):
                    t.cancel()
                self._session = None
