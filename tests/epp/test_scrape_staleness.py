"""A scrape that times out on a pod that answered before leaves it routable on its last
metrics for the grace, then down; a refused connection is down at once (pool/staleness.py).
Real aiohttp /metrics servers on loopback."""
from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import generate_latest

from kvyard.common.wire import DESTINATION_HEADER
from kvyard.epp.pool.endpoints import Endpoint, EndpointPool, EndpointSpec
from kvyard.epp.pool.staleness import COUNT, DOWN, STALE, TimeoutGrace
from kvyard.epp.prompt import LazyPrompt
from kvyard.epp.scheduling.filters import HealthyFilter, PreferFreshFilter
from kvyard.epp.scheduling.types import SchedRequest

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
METRICS = ('vllm:num_requests_waiting{model_name="m"} 1\n'
           'vllm:num_requests_running{model_name="m"} 2\n'
           'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n')


async def _dest(xp, app) -> str:
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
    return xp.set_headers(resps[0]).get(DESTINATION_HEADER, f"status {resps[0]}")


def _counter(app, outcome: str) -> float:
    text = generate_latest(app.metrics.registry).decode()
    line = f'kvyard_epp_scrape_timeouts_total{{outcome="{outcome}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


def test_grace_decides_by_the_last_good_scrape() -> None:
    g = TimeoutGrace(grace=2.0)
    assert g.on_timeout(Endpoint("a:1"), 100.0) == COUNT  # never scraped: nothing to route by
    ep = Endpoint("a:1", last_ok=99.0)
    assert [g.on_timeout(ep, t) for t in (100.0, 101.0)] == [STALE, STALE]
    assert g.on_timeout(ep, 101.5) == DOWN and (g.stale, g.expired) == (2, 1)
    ep.down = True
    assert g.on_timeout(ep, 102.0) == DOWN and g.expired == 1  # counted once per outage
    assert TimeoutGrace(grace=0).on_timeout(Endpoint("a:1", last_ok=99.0), 99.1) == COUNT


def test_a_pod_in_its_grace_is_not_dropped_for_staleness() -> None:
    now = 100.0
    fresh = Endpoint("a:1", last_ok=now - 0.1)
    late = Endpoint("b:1", last_ok=now - 3.0, timeouts=4)       # scrapes time out: busy
    failing = Endpoint("c:1", last_ok=now - 3.0, failures=2)    # HTTP errors: unknown state
    gone = Endpoint("d:1", last_ok=now - 9.0, timeouts=9, down=True)
    req = SchedRequest("m", LazyPrompt.of_hashes([]), now=now, stale_after=2.0)
    eps = [fresh, late, failing, gone]
    assert HealthyFilter().filter(req, eps) == [fresh, late, failing]
    assert PreferFreshFilter().filter(req, eps) == [fresh, late]
    pool = EndpointPool(stale_after=2.0)
    pool.set_source("t", [EndpointSpec("b:1")])
    pool.get("b:1").last_ok, pool.get("b:1").timeouts = now - 3.0, 4
    assert pool.ready(now)  # the EPP stays ready while its pods are only late
    pool.get("b:1").timeouts = 0
    assert not pool.ready(now)


async def test_stalled_metrics_keep_the_endpoint_for_the_grace_then_down(epp, xp,
                                                                          metrics_site):
    stall = asyncio.Event()
    release = asyncio.Event()

    async def metrics(_: web.Request) -> web.Response:
        if stall.is_set():
            await release.wait()  # far beyond the scrape timeout
        return web.Response(text=METRICS, content_type="text/plain")

    addr = await metrics_site(metrics)
    try:
        app = await epp([EndpointSpec(addr)], scrape_timeout=0.1, stale_after=0.5,
                        scrape_timeout_grace=3.0)
        ep = app.pool.get(addr)
        await xp.wait_for(lambda: ep.last_ok > 0, what="first scrape")
        stall.set()
        await xp.wait_for(lambda: ep.timeouts >= 2, what="timed-out scrapes")
        assert not ep.down and "Timeout" in ep.last_error
        assert (ep.waiting, ep.running, ep.kv_usage) == (1, 2, 0.5)  # its last metrics
        assert await _dest(xp, app) == addr  # still routable
        assert _counter(app, "stale") >= 2 and _counter(app, "down") == 0
        await xp.wait_for(lambda: ep.down, timeout=15.0, what="down once the grace ran out")
        assert "no metrics for 3s" in ep.last_error and _counter(app, "down") == 1
        assert HealthyFilter().filter(None, [ep]) == []  # no traffic now
        release.set()
        stall.clear()
        await xp.wait_for(lambda: not ep.down and ep.timeouts == 0, timeout=5.0, what="back")
    finally:
        release.set()


async def test_a_refused_port_is_down_at_once_despite_the_grace(fake_vllm, epp, xp, free_port):
    w, gone = await fake_vllm(), await fake_vllm()
    never = free_port()  # nothing listens: refused from the first scrape
    app = await epp([w, gone, EndpointSpec(f"127.0.0.1:{never}")], scrape_timeout_grace=30.0)
    e_gone, e_never = app.pool.get(gone.address), app.pool.get(f"127.0.0.1:{never}")
    await xp.wait_for(lambda: e_never.down, what="never-listening port down")
    assert e_never.failures == 1 and "unreachable" in e_never.last_error
    await xp.wait_for(lambda: e_gone.last_ok > 0, what="first scrape")
    await gone.stop()
    await xp.wait_for(lambda: e_gone.down, what="stopped endpoint down")
    assert "unreachable" in e_gone.last_error and e_gone.timeouts == 0
    assert _counter(app, "stale") == 0
    assert {await _dest(xp, app) for _ in range(5)} == {w.address}
