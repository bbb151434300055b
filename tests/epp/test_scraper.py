"""Scraping real aiohttp servers that speak vLLM's /metrics format."""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from kvyard.common.wire import DESTINATION_HEADER
from kvyard.epp.pool.metrics_parse import parse_vllm_metrics

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def _dest(xp, app) -> str:
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
    return xp.set_headers(resps[0]).get(DESTINATION_HEADER, f"status {resps[0]}")


def test_parser_reads_only_the_needed_gauges():
    text = ("# HELP vllm:num_requests_waiting x\n"
            'vllm:num_requests_waiting{engine="0"} 3.0\nvllm:num_requests_waiting{engine="1"} 2\n'
            'vllm:num_requests_running{engine="0"} 7\n'
            'vllm:gpu_cache_usage_perc{engine="0"} 0.25\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="512",x="y"} 1.0\n'
            'vllm:num_requests_running_bogus{} 99\nvllm:num_requests_running{a="b"} NaNx\n')
    m = parse_vllm_metrics(text)
    assert (m.waiting, m.running, m.kv_usage) == (5.0, 7.0, 0.25)
    assert (m.block_size, m.num_gpu_blocks) == (16, 512)
    assert parse_vllm_metrics("up 1\n").seen == 0
    both = parse_vllm_metrics('vllm:kv_cache_usage_perc 0.5\nvllm:gpu_cache_usage_perc 0.9\n')
    assert both.kv_usage == 0.5  # the current name wins over the old one


async def test_metrics_are_scraped_concurrently_and_kept_fresh(fake_vllm, epp, xp):
    w1, w2 = await fake_vllm(waiting=3, running=4, kv=0.5), await fake_vllm(kv=0.1)
    app = await epp([w1, w2])
    e1 = app.pool.get(w1.address)
    await xp.wait_for(lambda: e1.waiting == 3 and e1.kv_usage == 0.5, what="first scrape")
    assert (e1.running, e1.block_size, e1.num_gpu_blocks) == (4, 16, 1024)
    before = w2.scrapes
    await xp.wait_for(lambda: w2.scrapes >= before + 5, what="repeated scrapes")
    w1.waiting = 9
    await xp.wait_for(lambda: e1.waiting == 9, timeout=1.0, what="new value")


async def test_dead_endpoint_dropped_within_1s_and_returns(fake_vllm, epp, xp):
    w1, w2 = await fake_vllm(), await fake_vllm()
    app = await epp([w1, w2], seed=1)
    await xp.wait_for(lambda: all(e.fresh(time.monotonic(), 2.0) for e in app.pool.all()),
                      what="both fresh")
    await w1.stop()
    took = await xp.wait_for(lambda: app.pool.get(w1.address).down, timeout=3.0,
                             what="dead endpoint marked down")
    assert took < 1.0
    assert {await _dest(xp, app) for _ in range(10)} == {w2.address}
    await w1.start()  # same port
    await xp.wait_for(lambda: not app.pool.get(w1.address).down, timeout=3.0, what="recovery")
    seen = set()
    for _ in range(40):
        seen.add(await _dest(xp, app))
        if w1.address in seen:
            break
    assert w1.address in seen


async def test_hung_endpoint_dropped_after_repeated_timeouts(fake_vllm, epp, xp, free_port):
    never = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await never.wait()
        return web.Response(text="")

    web_app = web.Application()
    web_app.router.add_get("/metrics", hang)
    runner = web.AppRunner(web_app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        w = await fake_vllm()
        from kvyard.epp.pool.endpoints import EndpointSpec
        app = await epp([EndpointSpec(f"127.0.0.1:{port}"), EndpointSpec(w.address)])
        took = await xp.wait_for(lambda: app.pool.get(f"127.0.0.1:{port}").down, timeout=5.0,
                                 what="hung endpoint down")
        assert took < 1.5  # 3 x 0.3 s timeouts plus scheduling slack on a busy machine
        assert "Timeout" in app.pool.get(f"127.0.0.1:{port}").last_error
        assert await _dest(xp, app) == w.address
    finally:
        never.set()
        await runner.cleanup()


def test_parser_reads_the_pending_prompt_tokens_gauge():
    from kvyard.epp.pool.metrics_parse import parse_vllm_metrics
    text = ('vllm:num_requests_waiting{model_name="m"} 2\n'
            '# HELP kvyard:prompt_tokens_pending Prompt tokens not computed yet.\n'
            'kvyard:prompt_tokens_pending{model_name="m"} 1536.0\n')
    assert parse_vllm_metrics(text).prompt_tokens_pending == 1536.0
    assert parse_vllm_metrics('vllm:num_requests_waiting{a="b"} 2\n').prompt_tokens_pending is None
