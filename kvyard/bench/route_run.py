"""One `kvyard bench route` target (an EPP policy or a peer router) over a workload.

Every target gets a fresh pool (cold caches; `route_stack`): pods, the EPP with the
policy's scheduler config, Envoy. A peer router is started in front of the same
pods and is sent the traffic instead of Envoy. Each rung of the rate
ladder is replayed open loop (requests leave at their arrival times whatever the
answers do), and the pods' counters are read before and after it.
"""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import aiohttp

from kvyard.bench.client import RequestResult, completion_body, stream
from kvyard.bench.route_metrics import RungResult, Slo, pool_delta, scrape
from kvyard.bench.route_peers import Peer
from kvyard.bench.route_policies import Policy
from kvyard.bench.route_stack import Pods
from kvyard.bench.route_workload import RouteRequest
from kvyard.stack import procs


@dataclass(slots=True)
class Workload:
    """The rungs to replay (each a list of requests) and their prompts as text."""

    rates: list[float]
    rungs: list[list[RouteRequest]]
    texts: list[list[str]]
    ideal: list[float]             # the ideal cache's hit rate per rung, caches carried over


async def replay(url: str, model: str | None, reqs: Sequence[RouteRequest], texts: Sequence[str],
                 timeout_s: float) -> tuple[list[RequestResult], float]:
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t0 = loop.time()

        async def one(i: int, r: RouteRequest) -> RequestResult:
            delay = t0 + r.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            res = await stream(s, url, completion_body(model, texts[i], r.output_tokens))
            res.index = i
            return res

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        return list(results), loop.time() - t0


def _served_model(address: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{address}/v1/models", timeout=5) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


@dataclass(slots=True)
class TargetRun:
    name: str
    rungs: list[RungResult] = field(default_factory=list)
    unavailable: str | None = None
    epp_cpu_s_per_req: float = math.nan
    notes: list[str] = field(default_factory=list)

    def summary(self, slo: Slo) -> dict:
        if self.unavailable:
            return {"unavailable": self.unavailable}
        rows = [r.summary(slo) for r in self.rungs]
        top = dict(rows[-1]) if rows else {}
        top["by_rate"] = rows
        if not math.isnan(self.epp_cpu_s_per_req):  # a peer's traffic skips the EPP
            top["epp_cpu_s_per_req"] = self.epp_cpu_s_per_req
        if self.notes:
            top["notes"] = self.notes
        return top


def _epp_cpu(stack) -> float:
    """CPU-seconds of every EPP replica together."""
    return sum(procs.cpu_seconds(e.pid) for e in stack.epps)


def run_target(name: str, pods: Pods, work: Workload, run_root: Path, timeout_s: float,
               policy: Policy | None = None, peer: Peer | None = None) -> TargetRun:
    """One target over every rung, on a pool of its own."""
    from kvyard.bench import route_peers, route_stack

    out = TargetRun(name)
    if policy is not None and policy.unavailable:
        out.unavailable = policy.unavailable
        return out
    if peer is not None and peer.executable() is None:
        out.unavailable = "not installed"
        return out
    run = run_root / name.replace(":", "-")
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    stack = route_stack.start(pods, run, policy.write(run) if policy else None,
                              epp_replicas=policy.replicas if policy else 1)
    front = None
    try:
        url = stack.url
        model = _served_model(stack.addresses[0])
        if peer is not None:
            front = route_peers.start(peer, stack.addresses, run / "logs", stack.kv_events, model)
            if isinstance(front, str):
                out.unavailable = front
                return out
            url = front.url
        cpu0, sent = _epp_cpu(stack), 0
        for rate, reqs, texts, ideal in zip(work.rates, work.rungs, work.texts, work.ideal):
            before = asyncio.run(scrape(stack.addresses))
            results, wall = asyncio.run(replay(url, model, reqs, texts, timeout_s))
            after = asyncio.run(scrape(stack.addresses))
            hit, imbalance = pool_delta(before, after)
            out.rungs.append(RungResult(rate, results, wall, hit, imbalance, ideal))
            sent += len(reqs)
        if peer is None:
            out.epp_cpu_s_per_req = (_epp_cpu(stack) - cpu0) / max(1, sent)
    finally:
        if front is not None and not isinstance(front, str):
            route_peers.stop(front)
            out.notes += route_peers.log_notes(front)
        route_stack.stop(stack)
    return out
