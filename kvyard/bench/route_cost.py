"""What the EPP costs as the pool grows (`kvyard bench route`'s `epp_cost`).

- Idle CPU: the fraction of one core an EPP process uses while it only watches
  N pods (scrapes their /metrics at its default interval; no traffic), N from 8
  to 256. The pods are stand-ins served by one process (`route_pods`).
- Decision latency p50/p99 and prefix-index memory at N endpoints: the director
  `kvyard epp` runs, in process (`epp_api`), over a shared-prefix workload, with
  the index's live allocations traced (tracemalloc) after the decisions.
- CPU-seconds per request comes from the policy runs (`route_run`).
"""
from __future__ import annotations

import gc
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

from kvyard.bench.report import percentile
from kvyard.stack import procs

POD_COUNTS = (8, 32, 64, 128, 256)
_HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}


def idle_cpu(pods: int, watch_s: float, model: str = "demo", timeout_s: float = 120.0) -> dict:
    from kvyard.stack.commands import epp_cmd, py_module
    from kvyard.stack.endpoints_file import write_endpoints
    from kvyard.stack.readiness import epp_sees

    with tempfile.TemporaryDirectory(prefix="kvyard-route-cost-") as tmp:
        run = Path(tmp)
        taken: set[int] = set()
        ports = [procs.free_port(None, taken) for _ in range(pods)]
        eports = tuple(procs.free_port(None, taken) for _ in range(3))
        started = []
        try:
            host = procs.spawn("pods", py_module("kvyard.bench.route_pods", "--ports",
                                                 *map(str, ports)), run / "pods.log")
            started.append(host)
            procs.wait_ready([(host, lambda: all(procs.tcp_ok(p) for p in ports[-1:]))],
                             timeout_s)
            addrs = [f"127.0.0.1:{p}" for p in ports]
            epp = procs.spawn("epp", epp_cmd(model, eports, write_endpoints(
                run / "endpoints.yaml", addrs), ["--scaler-port", str(procs.free_port(None,
                                                                                   taken))]),
                run / "epp.log")
            started.append(epp)
            procs.wait_ready([(epp, epp_sees(f"http://127.0.0.1:{eports[2]}", pods))], timeout_s)
            c0, t0 = procs.cpu_seconds(epp.pid), time.monotonic()
            time.sleep(watch_s)
            cpu = procs.cpu_seconds(epp.pid) - c0
            return {"pods": pods, "idle_cpu_cores": cpu / (time.monotonic() - t0)}
        finally:
            procs.stop([p.pid for p in reversed(started)])


def _bodies(n: int, prompt_words: int, groups: int, seed: int) -> list[bytes]:
    """Shared-prefix chat bodies: `groups` system prompts, a new question each."""
    import random

    from kvyard.bench.route_workload import Segment, Vocab

    vocab = Vocab.demo()
    rng = random.Random(seed)
    prefix = [vocab.text(Segment(g, prompt_words * 5 // 6).ids(vocab.ids)) for g in range(groups)]
    out = []
    for i in range(n):
        q = vocab.text(Segment(10_000 + i, prompt_words // 6).ids(vocab.ids))
        msgs = [{"role": "system", "content": prefix[rng.randrange(groups)]},
                {"role": "user", "content": q}]
        out.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 16}).encode())
    return out


def decisions(endpoints: int, iterations: int, prompt_tokens: int = 7200,
              groups: int = 32) -> dict:
    """Decision latency and the prefix index's memory at `endpoints` endpoints."""
    from kvyard.bench.epp_api import build_director
    from kvyard.epp.scheduling.types import Decision

    bodies = _bodies(iterations, prompt_tokens, groups, seed=endpoints)

    def run(director) -> list[float]:
        lat = []
        for body in bodies:
            t0 = time.perf_counter()
            d = director.handle(_HEADERS, body)
            lat.append(time.perf_counter() - t0)
            if type(d) is Decision and d.prompt is not None:
                director.scheduler.learn(d.endpoint.address, d.prompt.finish())
        return lat

    lat = run(build_director(endpoints))
    # Memory on a second director, traced: tracing slows the decisions it would time.
    director = build_director(endpoints)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    run(director)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    flt = [tracemalloc.Filter(True, "*prefix_index.py"), tracemalloc.Filter(True, "*hashing.py")]
    grown = sum(s.size_diff for s in after.filter_traces(flt).compare_to(
        before.filter_traces(flt), "filename"))
    return {"endpoints": endpoints, "decision_p50": percentile(lat, 50),
            "decision_p99": percentile(lat, 99), "index_mb": max(0, grown) / 2**20,
            "requests": iterations}


def epp_cost(pod_counts: list[int], iterations: int, watch_s: float) -> dict:
    return {"idle": [idle_cpu(n, watch_s) for n in pod_counts],
            "decisions": [decisions(n, iterations) for n in pod_counts]}
