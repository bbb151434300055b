"""`kvyard sim serve --start-delay`: a pod binds at once but answers 503 until its
simulated start time has passed (/health says "starting", the EPP's scrape fails, a
request gets an OpenAI-style error), then serves."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from kvyard.sim import config
from kvyard.sim.startup import ready_at


def test_the_delay_is_simulated_seconds_and_parses_as_a_duration() -> None:
    assert ready_at(90.0, 2.0, now=100.0) == 145.0  # 90 simulated s at 2x: 45 wall s
    assert ready_at(-1.0, 1.0, now=5.0) == 5.0
    import argparse

    p = argparse.ArgumentParser()
    config.add_arguments(p)
    assert p.parse_args(["--start-delay", "2m"]).start_delay == 120.0
    assert p.parse_args([]).start_delay == 0.0


async def test_a_starting_pod_is_not_ready_and_serves_nothing(start_pods) -> None:
    async with start_pods(1, ready_at=time.monotonic() + 3600) as g, \
            aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        async with s.get(base + "/health") as r:
            assert r.status == 503 and (await r.json())["status"] == "starting"
        async with s.get(base + "/metrics") as r:
            assert r.status == 503
        async with s.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 503
            err = (await r.json())["error"]
            assert err["code"] == "starting" and "starting" in err["message"]


async def test_a_pod_serves_once_its_start_delay_has_passed(start_pods) -> None:
    async with start_pods(1, ready_at=time.monotonic() + 0.3) as g, \
            aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        deadline = time.monotonic() + 10.0
        while True:
            async with s.get(base + "/health") as r:
                if r.status == 200:
                    break
                assert r.status == 503
            assert time.monotonic() < deadline, "the pod never became ready"
            await asyncio.sleep(0.05)  # polling for readiness, with a deadline
        async with s.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
