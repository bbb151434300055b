"""Capacity measured online: the EPP's real scraper reads a worker's real /metrics
exposition (workers/server/metrics.py) whose counters advance as an engine with a
known prefill rate and TPOT curve would, and the scaler's metric uses what it measured."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
from aiohttp import web

from kvyard.common import keda
from kvyard.epp.flow.demand import Demand
from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec
from kvyard.epp.pool.scraper import Scraper
from kvyard.epp.scaler.server import ScalerConfig, ScalerServer
from kvyard.workers.engine.api import EngineStats
from kvyard.workers.server.metrics import ServerMetrics

pb2 = keda.pb2
RATE = 6000.0  # prompt tokens/s while a queue waits
PROMPT = 300.0  # tokens per request
A, C = 0.005, 0.001  # TPOT(b) = A + C*b seconds
TPOT_OBJ = 0.05  # -> (0.05 - 0.005) / 0.001 = 45 sequences per replica


@dataclasses.dataclass
class Engine:
    """Counters that advance with wall time as the model above says."""

    stats: EngineStats
    metrics: ServerMetrics = dataclasses.field(init=False)
    _prompt_acc: float = 0.0
    _prefilled: int = 0
    _finished: int = 0
    _gen: float = 0.0
    _prompt: float = 0.0

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.stats, "m")

    def advance(self, dt: float) -> None:
        s = self.stats
        if s.num_waiting > 0:
            self._prompt += RATE * dt
            self._prompt_acc += RATE * dt
            while self._prompt_acc >= PROMPT:
                self._prompt_acc -= PROMPT
                self._prefilled += 1
        # a request finishes after decoding: the running ones are prefilled, not finished
        while self._finished < self._prefilled - s.num_running:
            self._finished += 1
            self.metrics.success.labels(finished_reason="stop").inc()
        if s.num_running > 0:
            self._gen += s.num_running * dt / (A + C * s.num_running)
        self.stats = dataclasses.replace(s, prompt_tokens_total=int(self._prompt),
                                         generation_tokens_total=int(self._gen))

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)  # the engine's step period, not a sync point
            now = time.monotonic()
            self.advance(now - last)
            last = now


async def until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_capacity_is_measured_from_scrapes_and_drives_the_metric(free_port):
    eng = Engine(EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=1000,
                             block_size=16, prefix_queries_tokens=0, prefix_hits_tokens=0,
                             num_preemptions=0, prompt_tokens_total=0,
                             generation_tokens_total=0))

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=eng.metrics.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    addr = f"127.0.0.1:{port}"

    pool, demand = EndpointPool(), Demand()
    pool.set_source("static", [EndpointSpec(addr, "both")])
    scaler = ScalerServer(pool, demand, "p", ScalerConfig(window_s=0.25))
    scraper = Scraper(pool, interval=0.02, timeout=1.0)
    scraper.observers.append(scaler.observe)
    sport = await scaler.start("127.0.0.1", 0)
    tasks = [asyncio.create_task(eng.run()), asyncio.create_task(scraper.run())]
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{sport}")
    stub = keda.pb2_grpc.ExternalScalerStub(ch)
    r = pb2.ScaledObjectRef(name="w", namespace="ns", scalerMetadata={
        "pool": "p", "role": "both", "tpotMs": str(TPOT_OBJ * 1000)})

    async def value() -> float:
        got = await stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=r))
        return got.metricValues[0].metricValueFloat

    try:
        await until(lambda: pool.get(addr).last_ok > 0, what="first scrape")
        fallback_decode = (await value(), scaler.capacity.role("both").decode_measured)
        assert fallback_decode == (0.0, False)
        rc = scaler.capacity.role("both")
        for running in (4, 12, 4, 12):  # two batch sizes give the TPOT curve its slope
            eng.stats = dataclasses.replace(eng.stats, num_running=running, num_waiting=2)
            start = rc.windows
            await until(lambda: rc.windows >= start + 4, what=f"windows at batch {running}")
        snap = rc.snapshot(TPOT_OBJ, scaler.capacity.fallback)
        assert snap["measured"] == {"prefill": True, "prompt": True, "decode": True}
        assert snap["prefill_tokens_per_s"] == pytest.approx(RATE, rel=0.15)
        assert snap["prompt_tokens"] == pytest.approx(PROMPT, rel=0.15)
        assert snap["decode_sequences"] == pytest.approx(45, rel=0.25)
        # the metric divides by what was measured, not by the fallback (16 sequences)
        eng.stats = dataclasses.replace(eng.stats, num_running=30, num_waiting=0)
        await until(lambda: pool.get(addr).running == 30 and pool.get(addr).waiting == 0,
                    what="the new load scraped")
        cap = rc.decode_sequences(TPOT_OBJ, scaler.capacity.fallback)
        assert await value() == pytest.approx(30 / cap, rel=1e-6)
        assert 0.5 < await value() < 0.9  # the fallback would have said 30/16 > 1
        assert (await stub.IsActive(r)).result is True
        # the endpoint leaves (scaled to zero): metric present at 0, what was measured stays
        pool.set_source("static", [])
        assert await value() == 0.0 and (await stub.IsActive(r)).result is False
        assert rc.decode_sequences(TPOT_OBJ, scaler.capacity.fallback) == cap
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await ch.close()
        await scaler.stop()
        await runner.cleanup()


def test_parser_reads_the_counters_summed_and_none_when_absent():
    from kvyard.epp.pool.metrics_parse import parse_vllm_metrics

    m = parse_vllm_metrics(
        'vllm:prompt_tokens_total{engine="0"} 100\nvllm:prompt_tokens_total{engine="1"} 20\n'
        'vllm:generation_tokens_total{engine="0"} 7.0\n'
        'vllm:request_success_total{finished_reason="stop"} 2\n'
        'vllm:request_success_total{finished_reason="length"} 1\n'
        'vllm:request_success_created{finished_reason="stop"} 1.7e9\n')
    assert (m.prompt_tokens, m.generation_tokens, m.finished) == (120.0, 7.0, 3.0)
    bare = parse_vllm_metrics("vllm:num_requests_running 1\n")
    assert (bare.prompt_tokens, bare.generation_tokens, bare.finished) == (None, None, None)


def _feed(cap, ep, windows, batch, tpot, t0=0.0, prompt_rate=0.0, waiting=0.0):
    """Scrapes every 0.05 s of an engine at `batch` sequences and per-sequence `tpot`."""
    from kvyard.epp.pool.metrics_parse import WorkerMetrics

    t, gen, prompt = t0, 0.0, 0.0
    for _ in range(int(windows * cap.window_s / 0.05) + 1):
        cap.observe(ep, WorkerMetrics(running=batch, waiting=waiting, prompt_tokens=prompt,
                                      generation_tokens=gen, finished=0.0), t)
        t += 0.05
        gen += batch * 0.05 / tpot
        prompt += prompt_rate * 0.05
    return t


def test_tpot_fit_edge_cases():
    from kvyard.epp.scaler.capacity import Capacity
    from kvyard.epp.pool.endpoints import Endpoint

    fb_cap = Capacity()
    assert fb_cap.role("decode").decode_sequences(0.05, fb_cap.fallback) == 16  # 0.05*8/0.025
    # one batch size only: proportional, TPOT assumed to grow with the batch (conservative)
    cap, ep = Capacity(), Endpoint("a:1", "decode")
    _feed(cap, ep, 5, batch=4, tpot=0.01)
    assert cap.role("decode").decode_sequences(0.05, cap.fallback) == pytest.approx(20, rel=0.05)
    # TPOT that does not grow with the batch: no positive slope, proportional again
    cap, ep = Capacity(), Endpoint("a:1", "decode")
    t = _feed(cap, ep, 5, batch=4, tpot=0.02)
    cap.forget(ep.address)
    _feed(cap, ep, 5, batch=12, tpot=0.02, t0=t)
    assert cap.role("decode").decode_sequences(0.05, cap.fallback) == pytest.approx(20, rel=0.05)
    # a prefill endpoint's windows teach prefill only; a queue throughout = at capacity
    cap, ep = Capacity(), Endpoint("p:1", "prefill")
    _feed(cap, ep, 5, batch=2, tpot=0.01, prompt_rate=5000.0, waiting=3)
    rc = cap.role("prefill")
    assert not rc.decode_measured and rc.prefill_tokens_per_s == pytest.approx(5000, rel=0.05)


def test_counter_reset_restarts_the_window():
    from kvyard.epp.scaler.capacity import Capacity
    from kvyard.epp.pool.endpoints import Endpoint
    from kvyard.epp.pool.metrics_parse import WorkerMetrics

    cap, ep = Capacity(window_s=1.0), Endpoint("a:1", "both")
    cap.observe(ep, WorkerMetrics(running=1, prompt_tokens=1e6, generation_tokens=1e6), 0.0)
    # the worker restarted: counters back near zero; no negative (or huge) rate is learned
    cap.observe(ep, WorkerMetrics(running=1, prompt_tokens=10, generation_tokens=10), 0.5)
    cap.observe(ep, WorkerMetrics(running=1, prompt_tokens=510, generation_tokens=60), 1.6)
    rc = cap.role("both")
    assert rc.windows == 1 and rc.prefill_tokens_per_s == pytest.approx(500 / 1.1)
