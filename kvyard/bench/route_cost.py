"""What the EPP costs as the pool grows (`kvyard bench route`'s `epp_cost`).

- Idle CPU: the fraction of one core an EPP process uses while it only watches
  N pods (scrapes their /metrics at its default interval; no traffic), N from 8
  to 256. The pods are stand-ins served by one process (`route_pods`).
- Decision latency p50/p99 and prefix-index memory at N endpoints: the director
  `kvyard epp` runs, in process (`epp_api`), over a shared-prefix workload, with
  the index's live allocations traced (tracemalloc) after the decisions.
- CPU-seconds per request: end to end from the policy runs (`route_run`, EPP process
  CPU / requests, scraping and gRPC included), and in process at 100 endpoints with
  100k-token prompts, shared-prefix and unique (`request_cpu`).
- The precise index at scale (`index_scale`): decision latency and memory with up to
  10 million indexed blocks.
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


def idle_cpu(pods: int, watch_s: float, model: str = "demo", timeout_s: float = 120.0,
             extra: list[str] | None = None) -> dict:
    """`extra`: more `kvyard epp` flags (e.g. the precise config and its event port)."""
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
                                                                                   taken)),
                                                        *(extra or [])]),
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


def epp_cost(pod_counts: list[int], iterations: int, watch_s: float,
             index_blocks: int = 100_000) -> dict:
    """`requests`: CPU per 100k-token request at 100 endpoints (both prefix policies,
    shared and unique prompts); `index`: decisions over a precise index of `index_blocks`
    blocks at the smallest and largest pod count (`python -m kvyard.bench.route_cost
    --index-blocks 10000000` for the 10-million-block point)."""
    ends = sorted({min(pod_counts), max(pod_counts)})
    return {"idle": [idle_cpu(n, watch_s) for n in pod_counts],
            "decisions": [decisions(n, iterations) for n in pod_counts],
            "requests": [request_cpu(100, 100_000, 2, shared, policy)
                         for policy in ("approx_prefix", "precise_prefix")
                         for shared in (True, False)],
            "index": [index_scale(n, index_blocks) for n in ends]}


# ---- CPU per request and the precise index at scale -------------------------------------
ENGINE_BS = 16  # the engine block size the synthetic KV events carry


def _precise_director(endpoints: int):
    """The in-process director with the precise-prefix-cache config, every endpoint
    subscribed (as if each published KV events)."""
    import importlib.util

    from kvyard.bench.epp_api import build_director
    from kvyard.epp.scheduling.scorers.precise_prefix import PrecisePrefixScorer

    config = Path(importlib.util.find_spec("kvyard.epp").origin).parent / \
        "scheduler.precise.example.yaml"
    director = build_director(endpoints, config=str(config))
    scorers = [s for prof in director.scheduler.profiles.values() for s, _ in prof.scorers
               if isinstance(s, PrecisePrefixScorer)]
    index = scorers[0].index
    for e in director.pool.all():
        index.subscribed.add(e.address)
        index.block_size[e.address] = ENGINE_BS
    return director, index


def _long_bodies(n: int, tokens: int, shared: bool, seed: int) -> list[bytes]:
    """Chat bodies of ~`tokens` tokens: a common 95% system prompt and a new question
    (shared), or entirely new text each (unique)."""
    from kvyard.bench.route_workload import Segment, Vocab

    vocab = Vocab.demo()
    system = vocab.text(Segment(seed, tokens * 95 // 100).ids(vocab.ids)) if shared else None
    out = []
    for i in range(n):
        own = tokens - (tokens * 95 // 100 if shared else 0)
        msgs = [{"role": "user", "content": vocab.text(Segment(seed + 1 + i, own).ids(vocab.ids))}]
        if system:
            msgs.insert(0, {"role": "system", "content": system})
        out.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 16}).encode())
    return out


def request_cpu(endpoints: int = 100, tokens: int = 100_000, iterations: int = 5,
                shared: bool = True, policy: str = "approx_prefix") -> dict:
    """EPP CPU-seconds per request in process: the decision (body parse, template,
    tokenization as far as the walk goes, hashing, scoring) plus what the finisher does
    after the answer (the rest of the prompt tokenized and learned). Process CPU time, so
    the tokenizer's own threads count. No gRPC: that is in the policy runs' figure."""
    from kvyard.bench.epp_api import build_director
    from kvyard.epp.scheduling.types import Decision

    director = _precise_director(endpoints)[0] if policy == "precise_prefix" else \
        build_director(endpoints)
    bodies = _long_bodies(iterations + 1, tokens, shared, seed=7)
    decide, total = [], []
    for i, body in enumerate(bodies):
        c0 = time.process_time()
        d = director.handle(_HEADERS, body)
        c1 = time.process_time()
        if type(d) is Decision and d.prompt is not None:
            director.scheduler.learn(d.endpoint.address, d.prompt.finish())
        c2 = time.process_time()
        if i:  # the first request warms the template and the shared prefix's chunks
            decide.append(c1 - c0)
            total.append(c2 - c0)
    return {"endpoints": endpoints, "prompt_tokens": tokens, "shared_prefix": shared,
            "policy": policy, "decision_cpu_s": percentile(decide, 50),
            "cpu_s_per_request": percentile(total, 50), "requests": iterations}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def index_scale(endpoints: int, blocks: int, iterations: int = 50,
                prompt_tokens: int = 7200, chain: int = 64) -> dict:
    """Decision latency with the precise index holding `blocks` blocks spread over the
    endpoints (chains of `chain` blocks of random tokens, as BlockStored events), and the
    index's memory (resident growth while filling, and its own byte estimate)."""
    import random

    from kvyard.epp.request import parse_request
    from kvyard.epp.scheduling.types import Decision

    director, index = _precise_director(endpoints)
    addrs = [e.address for e in director.pool.all()]
    rng = random.Random(endpoints)
    gc.collect()
    rss0, t0 = _rss_bytes(), time.perf_counter()
    n, ekey = 0, 1
    while n < blocks:
        k = min(chain, blocks - n)
        ids = [rng.getrandbits(15) for _ in range(k * ENGINE_BS)]
        index.store(addrs[(n // chain) % len(addrs)],
                    {"block_hashes": list(range(ekey, ekey + k)), "token_ids": ids,
                     "block_size": ENGINE_BS, "parent_block_hash": None})
        n, ekey = n + k, ekey + k
    fill_s = time.perf_counter() - t0
    gc.collect()
    rss = _rss_bytes() - rss0
    bodies = _bodies(iterations, prompt_tokens, groups=16, seed=endpoints)
    # each group's prompt really cached on two endpoints, as its events would say
    for g, body in enumerate(bodies[:16]):
        p = director.hasher.prompt(parse_request(body, _HEADERS[":path"], {}, None))
        ids = list(p.lead) + list(p.finish() and p.ids)
        full = len(ids) // ENGINE_BS * ENGINE_BS
        for a in (addrs[g % len(addrs)], addrs[(g * 7 + 3) % len(addrs)]):
            index.store(a, {"block_hashes": list(range(ekey, ekey + full // ENGINE_BS)),
                            "token_ids": ids[:full], "block_size": ENGINE_BS,
                            "parent_block_hash": None})
            ekey += full // ENGINE_BS
    lat = []
    for body in bodies:
        t = time.perf_counter()
        d = director.handle(_HEADERS, body)
        lat.append(time.perf_counter() - t)
        if type(d) is not Decision:
            raise RuntimeError(f"not routed: {d!r}")
    return {"endpoints": endpoints, "indexed_blocks": len(index.blocks),
            "decision_p50": percentile(lat, 50), "decision_p99": percentile(lat, 99),
            "index_rss_mb": rss / 2**20, "index_estimate_mb": index.bytes_used / 2**20,
            "fill_s": fill_s, "requests": iterations}


def main(argv: list[str] | None = None) -> int:
    """`python -m kvyard.bench.route_cost`: the EPP's cost alone, as JSON."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--pods", type=int, nargs="+", default=[8, 256])
    p.add_argument("--watch", type=float, default=10.0, help="idle seconds watched per count")
    p.add_argument("--request-tokens", type=int, default=100_000)
    p.add_argument("--request-endpoints", type=int, default=100)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--index-blocks", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--skip", nargs="*", default=[], choices=["idle", "requests", "index"])
    a = p.parse_args(argv)
    out: dict = {}
    if "idle" not in a.skip:
        out["idle"] = [idle_cpu(n, a.watch) for n in a.pods]
    if "requests" not in a.skip:
        out["requests"] = [request_cpu(a.request_endpoints, a.request_tokens, a.iterations,
                                       shared, policy)
                           for policy in ("approx_prefix", "precise_prefix")
                           for shared in (True, False)]
    if "index" not in a.skip:
        out["index"] = [index_scale(n, b) for n in a.pods for b in a.index_blocks]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
