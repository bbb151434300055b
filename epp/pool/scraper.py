"""Keeps every endpoint's load metrics fresh by scraping `/metrics`.

One kept-alive connection per endpoint (`metrics_conn.py`), one scrape in flight
per endpoint, all endpoints concurrently. Cadence: a round every `interval` scrapes
every *busy* endpoint (requests waiting or running, picks not yet seen in its
metrics, pending prompt tokens, failing, down, asleep or never scraped); an *idle*
one (all of those zero) only every `idle_interval`. An idle endpoint's metrics
cannot change until a request reaches it, and the EPP's own pick makes it busy
(`Endpoint.pending`), so it is scraped again at the next round; what an idle
endpoint costs is then a tenth of a busy one's at the defaults (50 ms / 0.5 s),
and its metrics are never older than `idle_interval` (< `stale_after`, 2 s).
A connection the endpoint closes while idle brings its scrape forward to the next
round. Failure policy, chosen so a dead worker stops getting traffic in
well under a second without flapping on one slow scrape:

* connection refused / unreachable → `down` at once (the process is gone);
* a timeout on an endpoint scraped before → *stale*: routable on its last metrics
  until `grace.grace` seconds after its last good scrape, then `down`
  (`staleness.py`: a busy pod answers late, it is not gone);
* other failures (reset, HTTP error, not vLLM text; a timeout on an endpoint never
  scraped) → `down` after `fail_threshold` in a row (3 × 0.3 s timeout < 1 s for a
  worker hung from the start);
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

from .endpoints import Endpoint, EndpointPool
from .metrics_conn import ConnectionPool, HttpError, Unreachable
from .metrics_parse import WorkerMetrics, parse_vllm_metrics
from .staleness import COUNT, STALE, TimeoutGrace

log = logging.getLogger("kvyard.epp.scraper")


@dataclass(slots=True)
class Scraper:
    pool: EndpointPool
    interval: float = 0.05
    timeout: float = 0.3
    fail_threshold: int = 3
    idle_interval: float = 0.5  # idle endpoints (module docstring); <= interval: no distinction
    grace: TimeoutGrace = field(default_factory=TimeoutGrace)  # timed-out scrapes (staleness.py)
    _conns: ConnectionPool | None = None
    _inflight: dict[str, asyncio.Task] = field(default_factory=dict)
    _started: dict[str, float] = field(default_factory=dict)  # address -> last scrape's start
    _generation: int = -1
    rounds: int = 0
    observers: list[Callable[[Endpoint, WorkerMetrics, float], None]] = field(default_factory=list)
    on_scraped: Callable[[], None] | None = None  # after each good scrape (flow control)

    @property
    def running(self) -> bool:
        return self._conns is not None

    async def scrape(self, ep: Endpoint) -> None:
        assert self._conns is not None
        try:
            status, body = await self._conns.get(ep.address, self.timeout)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            m = parse_vllm_metrics(body.decode("utf-8"))
            if m.seen == 0:
                raise ValueError("no vLLM metrics in the response")
        except Unreachable as e:
            self._failed(ep, f"unreachable: {e}", immediate=True)
            return
        except TimeoutError as e:  # before OSError, its base class
            self._timed_out(ep, f"TimeoutError: {e}")
            return
        except (asyncio.TimeoutError, OSError, HttpError, ValueError) as e:
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
        ep.timeouts = 0
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

    def _timed_out(self, ep: Endpoint, why: str) -> None:
        outcome = self.grace.on_timeout(ep, time.monotonic())
        if outcome == COUNT:
            self._failed(ep, why, immediate=False)
            return
        ep.timeouts += 1
        ep.last_error = why
        if outcome == STALE:
            if ep.timeouts == 1:
                log.info("endpoint %s: scrape timed out; routing on its last metrics for up "
                         "to %gs", ep.address, self.grace.grace)
            return
        self._failed(ep, f"{why} (no metrics for {self.grace.grace:g}s)", immediate=True)

    def _done(self, addr: str, task: asyncio.Task) -> None:
        if self._inflight.get(addr) is task:
            del self._inflight[addr]

    def idle(self, ep: Endpoint) -> bool:
        """Nothing can change this endpoint's metrics but a request the EPP would see."""
        return (ep.last_ok > 0.0 and not ep.down and not ep.sleeping and ep.failures == 0
                and ep.timeouts == 0 and ep.pending == 0 and ep.waiting == 0 and ep.running == 0
                and not ep.prompt_tokens_pending)

    def _lost(self, address: str) -> None:
        self._started.pop(address, None)  # scraped at the next round, idle or not

    def round(self) -> None:
        """Starts a scrape for every endpoint that has none in flight and is due."""
        eps = self.pool.all()
        if self.pool.generation != self._generation:  # membership changed: drop the gone
            self._generation = self.pool.generation
            live = {e.address for e in eps}
            self._started = {a: t for a, t in self._started.items() if a in live}
            if self._conns is not None:
                self._conns.keep_only(live)
        now = time.monotonic()
        slow = self.idle_interval > self.interval
        for ep in eps:
            if ep.address in self._inflight:
                continue
            if slow and now - self._started.get(ep.address, -1e9) < self.idle_interval \
                    and self.idle(ep):
                continue
            self._started[ep.address] = now
            t = asyncio.create_task(self.scrape(ep))
            self._inflight[ep.address] = t
            t.add_done_callback(lambda task, a=ep.address: self._done(a, task))
        self.rounds += 1

    async def run(self) -> None:
        self._conns = ConnectionPool(self.timeout, on_lost=self._lost)
        try:
            while True:
                self.round()
                await asyncio.sleep(self.interval)  # the scrape period, not a sync point
        finally:
            for t in list(self._inflight.values()):
                t.cancel()
            self._conns.close()
            self._conns = None
