"""Sleep mode as the EPP sees it: a worker exporting kvyard:sleeping 1 gets no traffic."""
from __future__ import annotations

import json

from kvyard.common.wire import DESTINATION_HEADER, M_SLEEPING
from kvyard.epp.pool.metrics_parse import parse_vllm_metrics

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def _dest(xp, app) -> str:
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
    return xp.set_headers(resps[0]).get(DESTINATION_HEADER, f"status {resps[0]}")


def test_parser_reads_the_sleep_gauge():
    base = 'vllm:num_requests_waiting{model_name="m"} 0\n'
    assert parse_vllm_metrics(base + f'{M_SLEEPING}{{model_name="m"}} 1.0\n').sleeping
    assert not parse_vllm_metrics(base + f'{M_SLEEPING}{{model_name="m"}} 0.0\n').sleeping
    assert not parse_vllm_metrics(base).sleeping            # stock vLLM: never asleep
    assert parse_vllm_metrics(f"{M_SLEEPING} 1\n").seen == 0  # alone it is no vLLM endpoint


async def test_sleeping_endpoint_gets_no_traffic_until_it_wakes(fake_vllm, epp, xp):
    awake, asleep = await fake_vllm(sleeping=0.0), await fake_vllm(sleeping=1.0)
    app = await epp([awake, asleep], seed=1)
    e_asleep = app.pool.get(asleep.address)
    await xp.wait_for(lambda: e_asleep.sleeping and app.pool.get(awake.address).last_ok > 0,
                      what="both scraped")
    assert {await _dest(xp, app) for _ in range(20)} == {awake.address}
    assert not e_asleep.down  # asleep is not down: its scrapes succeed
    asleep.sleeping = 0.0
    await xp.wait_for(lambda: not e_asleep.sleeping, timeout=3.0, what="woken endpoint seen")
    seen = set()
    for _ in range(40):
        seen.add(await _dest(xp, app))
    assert asleep.address in seen


async def test_all_asleep_is_no_endpoint(fake_vllm, epp, xp):
    w = await fake_vllm(sleeping=1.0)
    app = await epp([w], no_endpoint_ttl_s=0.05)  # held in the waiting room, then a 503
    await xp.wait_for(lambda: app.pool.get(w.address).sleeping, what="scraped asleep")
    assert (await _dest(xp, app)).startswith("status")
