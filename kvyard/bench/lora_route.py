"""`kvyard bench lora`'s routing half: LoRA-aware routing on simulated pods, same run.

Each policy gets a fresh pool (`route_stack`: simulated pods in one process, the EPP with
the policy's scheduler config and a models file naming the adapters, Envoy) and the same
requests. Pods: `kvyard sim serve --lora-modules a00 … --max-loras 4`, each adapter load
costing `--lora-load-time` (kvyard/sim/lora.py). Requests: Poisson arrivals; each names
an adapter drawn from a Zipf popularity; its prompt is that adapter's short system prompt
then a user part of its own (so the prefix scorer alone has a little adapter affinity,
as real traffic gives it).

Per policy: adapter loads (the pods' `kvyard:sim_lora_loads_total`, i.e. thrash), the
adapter hit rate (requests whose adapter was active on arrival: 1 - loads / requests),
the pool's prefix-cache hit rate, TTFT p50/p90 (simulated seconds: wall x the pods'
time scale) and errors.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvyard.bench.client import RequestResult, completion_body, stream
from kvyard.bench.report import percentile
from kvyard.bench.route_metrics import pool_delta, scrape

LOADS_METRIC = "kvyard:sim_lora_loads_total"
_WORDS = ("alpha beta gamma delta table query select join index order group river stone "
          "cloud light music paper window garden orange silver market engine signal").split()


@dataclass(slots=True)
class LoraWorkload:
    pods: int = 16
    adapters: int = 64
    max_loras: int = 4
    load_time: str = "500ms"
    requests: int = 1600
    rate: float = 40.0            # requests per second, Poisson
    zipf_s: float = 1.1           # popularity of adapter k ~ 1 / k^s
    system_words: int = 40        # each adapter's system prompt
    user_words: int = 300         # each request's own part
    output_tokens: int = 24
    profile: str = "h100"
    seed: int = 0

    def adapter_names(self) -> list[str]:
        return [f"a{i:02d}" for i in range(self.adapters)]


@dataclass(slots=True)
class LoraRequest:
    at_s: float
    adapter: str
    text: str


def build_requests(w: LoraWorkload) -> list[LoraRequest]:
    rng = random.Random(w.seed)
    names = w.adapter_names()
    weights = [1.0 / (k + 1) ** w.zipf_s for k in range(len(names))]
    system = {a: f"You are adapter {a}. " + " ".join(rng.choices(_WORDS, k=w.system_words))
              for a in names}
    out, t = [], 0.0
    for _ in range(w.requests):
        t += rng.expovariate(w.rate)
        a = rng.choices(names, weights)[0]
        user = " ".join(rng.choices(_WORDS, k=w.user_words))
        out.append(LoraRequest(t, a, f"{system[a]}\nUser: {user}\nAssistant:"))
    return out


async def replay(url: str, reqs: list[LoraRequest], output_tokens: int,
                 timeout_s: float) -> list[RequestResult]:
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t0 = loop.time()

        async def one(r: LoraRequest) -> RequestResult:
            delay = t0 + r.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            return await stream(s, url, completion_body(r.adapter, r.text, output_tokens))

        return list(await asyncio.gather(*(one(r) for r in reqs)))


async def _loads(addresses: list[str]) -> float:
    async def one(s: aiohttp.ClientSession, a: str) -> float:
        async with s.get(f"http://{a}/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith(LOADS_METRIC):
                    return float(line.split()[-1])
        return 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        return sum(await asyncio.gather(*(one(s, a) for a in addresses)))


def policy_configs(lora_weight: float) -> dict[str, list[dict]]:
    load = [{"type": "queue", "weight": 2}, {"type": "kv-cache-utilization", "weight": 2}]
    prefix = {"type": "prefix-cache", "weight": 3}
    return {"lora-affinity+prefix": [{"type": "lora-affinity", "weight": lora_weight}, prefix,
                                     *load],
            "prefix": [prefix, *load],
            "random": []}


def _write_config(run: Path, name: str, scorers: list[dict]) -> Path:
    cfg = {"profileHandler": {"type": "single-profile"},
           "profiles": {"default": {"filters": ["healthy", "prefer-fresh", "role"],
                                    "scorers": scorers,
                                    "picker": {"type": "max-score", "maxEndpoints": 1}}}}
    path = run / f"scheduler-{name}.yaml"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run_policy(name: str, scorers: list[dict], w: LoraWorkload, reqs: list[LoraRequest],
               run_root: Path, time_scale: float, timeout_s: float) -> dict:
    from kvyard.bench import route_stack
    from kvyard.common.models import resolve_model

    run = run_root / name.replace("+", "-")
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    names = w.adapter_names()
    models = run / "models.yaml"
    models.write_text(json.dumps({"models": [{"name": resolve_model("demo").served_name,
                                              "adapters": names}]}))
    pods = route_stack.Pods(count=w.pods, profile=w.profile, seed=w.seed, time_scale=time_scale,
                            extra=["--lora-modules", *names, "--max-loras", str(w.max_loras),
                                   "--lora-load-time", w.load_time])
    stack = route_stack.start(pods, run, _write_config(run, name.replace("+", "-"), scorers),
                              epp_args=["--models-file", str(models)])
    try:
        before, loads0 = asyncio.run(scrape(stack.addresses)), asyncio.run(_loads(stack.addresses))
        results = asyncio.run(replay(stack.url, reqs, w.output_tokens, timeout_s))
        after, loads1 = asyncio.run(scrape(stack.addresses)), asyncio.run(_loads(stack.addresses))
    finally:
        route_stack.stop(stack)
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * time_scale for r in ok]
    loads = loads1 - loads0
    hit, imbalance = pool_delta(before, after)
    return {
        "policy": name, "requests": len(results), "errors": len(results) - len(ok),
        "adapter_loads": loads, "adapter_hit_rate": 1.0 - loads / max(1, len(ok)),
        "prefix_hit_rate": hit, "imbalance": imbalance,
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90)}


def measure(w: LoraWorkload, run_root: Path, lora_weight: float, time_scale: float = 1.0,
            timeout_s: float = 300.0, only: list[str] | None = None) -> list[dict]:
    reqs = build_requests(w)
    rows = []
    for name, scorers in policy_configs(lora_weight).items():
        if only is None or name in only:
            rows.append(run_policy(name, scorers, w, reqs, run_root, time_scale, timeout_s))
    return rows


def verdict(rows: list[dict]) -> list[str]:
    """The issue's target: >= 3x fewer adapter loads and a better TTFT p90 than prefix."""
    by = {r["policy"]: r for r in rows}
    la, px = by.get("lora-affinity+prefix"), by.get("prefix")
    if not la or not px:
        return []
    ratio = px["adapter_loads"] / max(1.0, la["adapter_loads"])
    better = la["ttft_p90"] < px["ttft_p90"]
    return [f"adapter loads, prefix / lora-affinity+prefix: {ratio:.2f}x (target >= 3x: "
            f"{'met' if ratio >= 3 else 'NOT met'}); TTFT p90 {la['ttft_p90']:.3f}s vs "
            f"{px['ttft_p90']:.3f}s ({'better' if better else 'NOT better'})"]
