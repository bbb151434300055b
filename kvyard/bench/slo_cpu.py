"""`kvyard bench slo --cpu-workers N`: the predictors on real CPU workers (the demo model),
behind the same EPP and Envoy as the simulated pods, in a small held-out run.

Requests of mixed prompt lengths and tenants' output lengths, a few at a time; the
first `warmup` outcomes train the models, the errors are those of the predictions made
for the rest, each before its own outcome was learned.
"""
from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SLO_HEADERS = {"x-llm-d-slo-ttft-ms": "5000", "x-llm-d-slo-tpot-ms": "500"}


@dataclass(slots=True)
class CpuPods:
    """`route_stack`'s pods as real `kvyard worker` processes (one per pod; count 1)."""

    count: int = 1
    max_num_seqs: int = 4
    backend: str = "cpu"
    kv_blocks: int | None = None

    def command(self, ports: list[int], events: int | None, replay: int | None) -> list[str]:
        from kvyard.stack.commands import py_module

        return py_module("kvyard.cli", "worker", "--host", "127.0.0.1", "--port", str(ports[0]),
                         "--model", "demo", "--max-num-seqs", str(self.max_num_seqs))


class WithHeaders:
    """An aiohttp session whose posts carry one request's headers (`client.stream` posts
    through it: the one streaming client, unchanged)."""

    def __init__(self, session, headers: dict[str, str]) -> None:
        self.session, self.headers = session, headers

    def post(self, url: str, **kw):
        return self.session.post(url, headers=self.headers, **kw)


def snapshot(stack) -> dict:
    """The EPP's SLO state (`/debug/endpoints` → slo); {} if it cannot be read."""
    try:
        with urllib.request.urlopen(stack.epp_metrics + "/debug/endpoints", timeout=5) as r:
            return json.loads(r.read()).get("slo") or {}
    except (OSError, ValueError):
        return {}


def held_out(before: dict, after: dict) -> dict:
    """The errors of the predictions made between two snapshots."""
    out = {}
    for kind in ("ttft", "tpot"):
        b, a = before.get(kind, {}), after.get(kind, {})
        n = (a.get("samples") or 0) - (b.get("samples") or 0)
        if n <= 0:
            out[kind] = {"samples": 0, "mape": None, "p90_coverage": None}
            continue
        ape = (a["mape"] or 0) * a["samples"] - (b.get("mape") or 0) * (b.get("samples") or 0)
        cov = (a["p90_coverage"] or 0) * a["samples"] - (b.get("p90_coverage") or 0) * (
            b.get("samples") or 0)
        out[kind] = {"samples": n, "mape": ape / n, "p90_coverage": cov / n}
    b, a = before.get("output_len", {}), after.get("output_len", {})
    n = (a.get("samples") or 0) - (b.get("samples") or 0)
    if n > 0:
        def tot(d: dict, k: str) -> float:
            return (d.get(k) or 0) * (d.get("samples") or 0)
        out["output_len"] = {"samples": n, "mae": (tot(a, "mae") - tot(b, "mae")) / n,
                             "mae_baseline": (tot(a, "mae_baseline") - tot(b, "mae_baseline")) / n}
    return out


async def _send(url: str, n: int, concurrency: int, seed: int) -> int:
    import aiohttp

    from kvyard.bench.client import completion_body, stream

    rng = random.Random(seed)
    tenants = {f"t{i}": rng.randint(4, 24) for i in range(4)}
    sem = asyncio.Semaphore(concurrency)
    ok = 0

    async def one(i: int) -> None:
        nonlocal ok
        t = rng.choice(list(tenants))
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"])
                         for _ in range(rng.randint(20, 400)))
        body = completion_body(None, words, 64, ignore_eos=False)
        body["max_tokens"] = tenants[t]  # the worker stops at the tenant's length
        async with sem:
            r = await stream(WithHeaders(s, {**SLO_HEADERS, "x-llm-d-inference-fairness-id": t}),
                             url, body)
        ok += r.ok

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(one(i) for i in range(n)))
    return ok


def run_cpu(workers: int, requests: int, warmup: int, run: Path, seed: int = 0,
            trace: str = "") -> dict:
    """`trace`: the latency scorer's traceFile (for `slo_fit`), "" for none."""
    from kvyard.bench import route_stack
    from kvyard.bench.route_policies import Policy

    run.mkdir(parents=True, exist_ok=True)
    scorers = [{"type": "prefix-cache", "weight": 3}, {"type": "queue", "weight": 2},
               {"type": "latency", "weight": 4, "minSamples": warmup, "traceFile": trace}]
    stack = route_stack.start(CpuPods(workers), run, Policy("cpu", scorers).write(run),
                              timeout_s=600.0, observe_responses=True)
    try:
        asyncio.run(_send(stack.url, warmup, 2, seed))
        before = snapshot(stack)
        ok = asyncio.run(_send(stack.url, requests, 2, seed + 1))
        after = snapshot(stack)
    finally:
        route_stack.stop(stack)
    return {"workers": workers, "requests": requests, "ok": ok, "warmup": warmup,
            **held_out(before, after)}
