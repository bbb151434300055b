"""Predictive autoscaling on a real stack: `kvyard up --sim 1 --scale-to-zero --max-workers 3`
with the latency scorer (its arrival forecast) and the scaler's `signal: predictive`.
A rising arrival rate that one pod serves without a queue makes the local autoscaler
ask for more pods: the forecast asked, while the backlog metric alone (which the
autoscaler reads beside it, `signal: backlog`) would have kept one. Asserted on the values
the autoscaler recorded with its scale-up, not on timings."""
from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import aiohttp

from kvyard.bench.route_policies import LOAD, Policy
from kvyard.stack import autoscale
from kvyard.stack.state import StackState


def _scale_ups(rd: Path) -> list[dict]:
    pools = (autoscale.read_file(rd) or {}).get("pools") or [{}]
    return [e for e in pools[0].get("events", []) if e["to"] > e["from"]]


async def _ramp_until_scaled(url: str, rd: Path, deadline_s: float) -> list[dict]:
    """Requests at a rate rising by 1 req/s each second (from 2), until the autoscaler has
    scaled up or the deadline passes."""
    body = {"prompt": "hello " * 300, "max_tokens": 4}
    sent: list[asyncio.Task] = []
    async with aiohttp.ClientSession() as s:
        async def one() -> int:
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                return r.status

        t0 = time.monotonic()
        end = t0 + deadline_s
        while not (ups := _scale_ups(rd)) and time.monotonic() < end:
            rate = 2.0 + (time.monotonic() - t0)
            sent.append(asyncio.create_task(one()))
            await asyncio.sleep(1.0 / rate)  # the arrival schedule
        statuses = await asyncio.gather(*sent)
    assert set(statuses) == {200}, statuses
    return ups


def test_predictive_scaling_starts_pods_before_the_backlog_asks(up, tmp_path, wait_until
                                                                ) -> None:
    cfg = Policy("latency", [*LOAD, {"type": "latency", "weight": 1}]).write(tmp_path)
    state = up("--sim", "1", "--sim-profile", "h100", "--no-kv-events", "--scale-to-zero",
               "--max-workers", "3", "--idle-seconds", "600", "--polling-seconds", "0.5",
               "--no-prestart", "--epp-config", str(cfg),
               # a pod takes minutes to start: the forecast looks that far ahead
               "--scaler-metadata", "leadMs=300000", "--scaler-metadata", "ttftMs=2000")
    rd = up.run_dir
    auto = next(p for p in state.procs if p.name == "autoscaler")
    assert "--metadata=leadMs=300000" in auto.cmd
    ups = asyncio.run(_ramp_until_scaled(state.gateway_url, rd, deadline_s=25.0))
    assert ups, "the autoscaler never scaled up"
    first = ups[0]
    assert first["from"] == 1 and first["to"] > 1
    target = first["target"]
    # The metric (forecast included) asked for more than one pod ...
    assert math.ceil(first["metric"] / target) > 1
    # ... the backlog alone, read in the same poll, for one at most.
    assert first["backlog"] is not None and math.ceil(first["backlog"] / target - 1e-9) <= 1
    assert first["metric"] > first["backlog"]
    doc = autoscale.read_file(rd)
    assert doc["pools"][0]["max"] == 3 and doc["errors"] == 0
    # the supervisor acts on the wish: the pool grows past its one pod
    workers = wait_until(lambda: [p for p in StackState.load(rd).procs
                                  if p.name.startswith("worker-")][1:],
                         timeout=15, what="pods started for the scale-up")
    up.seen.update(p.pid for p in workers)
