"""`kvyard bench pd`: P/D (1 prefill + 1 decode worker) against 2 colocated workers.

Same hardware budget, same run: each setup is a real local stack (Envoy, EPP, two
workers on the demo model), each worker pinned to its own core (every thread of
its process, after start) with one torch thread. The workload is mixed, through
Envoy: `--streams` closed-loop clients keep short prompts decoding while long
prompts (`--long-tokens`, 2k by default) arrive every `--long-interval` seconds.
Per class it reports TTFT and TPOT p50/p99 and goodput (requests meeting the
stated SLO per second). For P/D also: handoff bytes, handoff (transfer) time
against the prefill alone (a long prompt's recompute on an idle worker), an idle
P/D request's TTFT against that prefill. `pd` streams the blocks while the prefill
computes (the default): it reports how many blocks arrived before the prefill
ended and the tail left after it. `pd-pull` (same-host memfd) and `pd-tcp` (a
decode worker told to use TCP) pull only once the prefill has answered, so a
pull's bandwidth can be set against loopback TCP measured in the same run, with
where its time goes (pd_handoff.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.bench import pd_handoff
from kvyard.bench.client import chat_body, stream, stream_once
from kvyard.bench.report import Report, percentile

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river mountain city "
         "bridge garden window market island forest winter summer music story letter engine "
         "paper water light table voice money field north south east west color animal").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per setup")
    p.add_argument("--streams", type=int, default=2, help="concurrent short decoding streams")
    p.add_argument("--short-tokens", type=int, default=64)
    p.add_argument("--short-output", type=int, default=48)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-interval", type=float, default=10.0,
                   help="seconds between long prompts (one prefill worker must keep up)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--slo-ttft-short", type=float, default=0.5, help="seconds")
    p.add_argument("--slo-ttft-long", type=float, default=6.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.06, help="seconds per output token")
    p.add_argument("--setups", default="colocated,pd,pd-pull,pd-tcp,pd-redis",
                   help="colocated; pd (streamed while the prefill computes), pd-pull (pulled "
                        "after it, same-host memfd), pd-tcp (pulled after it, TCP), pd-redis "
                        "(no pull: the blocks from a shared Redis tier)")
    p.add_argument("--json", action="store_true")


@dataclass(slots=True)
class Result:
    kind: str
    ok: bool
    ttft: float = float("nan")
    tpot: float = float("nan")
    tokens: int = 0


@dataclass(slots=True)
class Prompts:
    """Unique texts of about the asked token count (calibrated once with /tokenize)."""

    tokens_per_word: float
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    n: int = 0

    def text(self, tokens: int) -> str:
        self.n += 1
        words = [self.rng.choice(WORDS) for _ in range(int(tokens / self.tokens_per_word))]
        return f"Request {self.n}: " + " ".join(words)


def chat(text: str, max_tokens: int) -> dict:
    return chat_body("SmolLM2-135M-Instruct", text, max_tokens)


async def one(session, url: str, body: dict, kind: str) -> Result:
    r = await stream(session, url, body)  # a failed request counts as not good
    return Result(kind, r.ok, r.ttft_s, r.tpot_s, r.num_tokens)


async def workload(url: str, a: argparse.Namespace, prompts: Prompts) -> list[Result]:
    import aiohttp

    results: list[Result] = []
    stop = time.monotonic() + a.duration
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def shorts() -> None:
            while time.monotonic() < stop:
                results.append(await one(s, url, chat(prompts.text(a.short_tokens),
                                                      a.short_output), "short"))

        async def longs() -> None:
            tasks = []
            while time.monotonic() < stop:
                tasks.append(asyncio.ensure_future(one(s, url, chat(prompts.text(a.long_tokens),
                                                                    a.long_output), "long")))
                await asyncio.sleep(a.long_interval)  # the arrival process, not a synchronisation
            results.extend(await asyncio.gather(*tasks))
        await asyncio.gather(longs(), *[shorts() for _ in range(a.streams)])
    return results


def pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` on `cpu` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass


def metrics(address: str) -> dict[str, float]:
    from kvyard.stack import procs

    code, body = procs.http_get(f"http://{address}/metrics", 5.0)
    out: dict[str, float] = {}
    for line in body.decode().splitlines() if code == 200 else []:
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def _direct(url: str, body: dict) -> float:
    """One request on its own: its TTFT, or its whole time when it failed."""
    r = asyncio.run(stream_once(url, body))
    return r.ttft_s if r.ok else r.latency_s


def run_setup(name: str, a: argparse.Namespace, run_dir: Path, prompts: Prompts | None
              ) -> tuple[list[Result], dict, Prompts]:
    from kvyard.stack.launch import start_stack, stop_stack
    from kvyard.stack.spec import StackSpec

    pd = name.startswith("pd")
    redis = name == "pd-redis"
    # pd-redis: nobody pulls, so holds are let go quickly (the blocks went to Redis)
    transports = {"pd-pull": ["--no-pd-stream"],
                  "pd-tcp": ["--pd-transports", "tcp", "--no-pd-stream"],
                  "pd-redis": ["--pd-transports", "none", "--kv-hold-timeout", "2"]
                  }.get(name, [])
    spec = StackSpec(run_dir=run_dir / name, workers=2, prefill=int(pd), decode=int(pd),
                     dtype=a.dtype, gateway_port=None, worker_base_port=None,
                     epp_ports=(None, None, None), admin_port=None, scaler_port=None,
                     ready_timeout_s=600.0,
                     kv_tiers=redis, kv_pool_tier="redis" if redis else "ssd",
                     worker_args=["--max-model-len", "4096", "--kv-cache-memory-bytes",
                                  "768MiB", "--num-threads", "1", *transports])
    state = start_stack(spec)
    extra: dict = {}
    try:
        workers = [p for p in state.procs if p.name.startswith("worker-")]
        cpus = sorted(os.sched_getaffinity(0))
        for i, p in enumerate(workers):
            pin(p.pid, cpus[i % len(cpus)])
        if prompts is None:
            import urllib.request
            sample = " ".join(random.Random(1).choice(WORDS) for _ in range(400))
            req = urllib.request.Request(
                f"http://{state.endpoints[0]}/tokenize",
                json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": sample}).encode(),
                {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                prompts = Prompts(json.loads(r.read())["count"] / 400)
        # warm-up: one long and one short request (kernels, caches, EPP tokenizer)
        _direct(state.gateway_url, chat(prompts.text(a.long_tokens), 2))
        _direct(state.gateway_url, chat(prompts.text(a.short_tokens), 2))
        if pd:
            prefill_addr, decode_addr = state.endpoints
            alone = [_direct(f"http://{prefill_addr}", chat(prompts.text(a.long_tokens), 1))
                     for _ in range(3)]
            m0 = metrics(decode_addr)
            idle_pd = [_direct(state.gateway_url, chat(prompts.text(a.long_tokens), 2))
                       for _ in range(3)]
            m1 = metrics(decode_addr)
            extra["prefill_alone_s"] = percentile(alone, 50)
            extra["pd_idle_ttft_s"] = percentile(idle_pd, 50)
            extra["cpus"] = [cpus[0], cpus[1 % len(cpus)]]
            # the baseline beside this setup's idle handoffs: the same cores, the same minute
            extra.update(pd_handoff.loopback(extra["cpus"], pd_handoff.stats(m1, m0)))
        results = asyncio.run(workload(state.gateway_url, a, prompts))
        if pd:
            from kvyard.common import wire

            m2 = metrics(decode_addr)
            path = "store" if redis else "peer"
            extra["idle"] = pd_handoff.stats(m1, m0, path)
            extra["load"] = pd_handoff.stats(m2, m1, path)
            extra["fallbacks"] = sum(v for key, v in m2.items()
                                     if key.startswith(wire.M_PD_FALLBACKS))
    finally:
        stop_stack(state)
    return results, extra, prompts


def _good(r: Result, a: argparse.Namespace) -> bool:
    slo = a.slo_ttft_long if r.kind == "long" else a.slo_ttft_short
    return r.ok and r.ttft <= slo and (r.tpot != r.tpot or r.tpot <= a.slo_tpot)


def run(a: argparse.Namespace) -> int:
    rep = Report("kvyard bench pd: 2 colocated workers vs 1 prefill + 1 decode (one core each)",
                 ["setup", "class", "requests", "failed", "ttft_p50_s", "ttft_p99_s",
                  "tpot_p50_ms", "tpot_p99_ms", "goodput_rps"])
    tpot_p99: dict[str, float] = {}
    prompts = None
    with tempfile.TemporaryDirectory(prefix="kvyard-bench-pd-") as td:
        for name in [s.strip() for s in a.setups.split(",") if s.strip()]:
            results, extra, prompts = run_setup(name, a, Path(td), prompts)
            for kind in ("short", "long"):
                rs = [r for r in results if r.kind == kind]
                ok = [r for r in rs if r.ok]
                tp = [r.tpot * 1e3 for r in ok if r.tpot == r.tpot]
                rep.add(setup=name, **{"class": kind}, requests=len(rs), failed=len(rs) - len(ok),
                        ttft_p50_s=percentile([r.ttft for r in ok], 50),
                        ttft_p99_s=percentile([r.ttft for r in ok], 99),
                        tpot_p50_ms=percentile(tp, 50), tpot_p99_ms=percentile(tp, 99),
                        goodput_rps=sum(_good(r, a) for r in rs) / a.duration)
                if kind == "short":
                    tpot_p99[name] = percentile(tp, 99)
            rep.meta[name] = extra
    rep.notes.append(f"SLO: TTFT <= {a.slo_ttft_short}s (short, ~{a.short_tokens} tokens) / "
                     f"{a.slo_ttft_long}s (long, ~{a.long_tokens} tokens), TPOT <= "
                     f"{a.slo_tpot * 1e3:.0f} ms; {a.streams} short streams, a long prompt "
                     f"every {a.long_interval}s, {a.duration:.0f}s per setup, {a.dtype}.")
    if "colocated" in tpot_p99 and "pd" in tpot_p99:
        rep.notes.append(f"short-stream TPOT p99: P/D {tpot_p99['pd']:.1f} ms vs colocated "
                         f"{tpot_p99['colocated']:.1f} ms (ratio "
                         f"{tpot_p99['pd'] / tpot_p99['colocated']:.2f}; target <= 0.5)")
    pds = {k: v for k, v in rep.meta.items() if k.startswith("pd") and v}
    for name, pd in pds.items():
        for phase in ("idle", "load"):
            rep.notes.append(pd_handoff.note(name, phase, pd[phase], pd["prefill_alone_s"],
                                             pd["loopback_gbps"], pd["loopback_fresh_gbps"]))
        rep.notes.append(f"{name}: fallbacks to a local prefill: {pd['fallbacks']:.0f}")
        rep.notes.append(f"{name}: idle P/D TTFT {pd['pd_idle_ttft_s'] * 1e3:.0f} ms vs prefill "
                         f"alone {pd['prefill_alone_s'] * 1e3:.0f} ms "
                         f"({pd['pd_idle_ttft_s'] / pd['prefill_alone_s'] - 1:+.0%}; "
                         "target <= +10%)")
    rep.emit(a.json)
    return 0
