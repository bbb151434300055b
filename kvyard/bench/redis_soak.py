"""Redis memory under a soak: unique ~2k-token prompts through a `kvyard up --kv-redis`
stack of real workers, Redis's INFO sampled as it goes, against its maxmemory.

Why: every Redis kvyard starts is capped (kvstore/redis_conf.py); this shows where its
memory settles under a load that writes far more than the cap. Every prompt
starts with a fresh random line, so no two share a block: nothing is ever a hit,
every prefill writes its whole KV to Redis.

`soak()` starts its own stack in a temporary run dir and stops it at the end;
`kvyard bench hardening` runs it (`--soak-seconds`).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

WORDS = ("river stone garden window paper orange silver market letter engine winter "
         "harbor castle pencil forest summer bridge candle mirror ladder violin rocket "
         "meadow bottle copper island lantern marble pillow saddle thunder velvet").split()


def kvyard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=900)


def prompt(rng: random.Random, words: int) -> str:
    head = f"Request {rng.getrandbits(64):016x}. Summarise the following list.\n"
    return head + " ".join(rng.choice(WORDS) for _ in range(words))


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def written_to_redis(endpoints: list[str]) -> int:
    """Bytes the workers' Redis tiers sent (`kvyard:kvstore_bytes{tier="redis"}`: what
    each client wrote, evictions not subtracted)."""
    total = 0
    for a in endpoints:
        with urllib.request.urlopen(f"http://{a}/metrics", timeout=10) as r:  # noqa: S310
            for line in r.read().decode().splitlines():
                if line.startswith('kvyard:kvstore_bytes{tier="redis"}'):
                    total += int(float(line.split()[-1]))
    return total


def redis_info(port: int, password: str) -> dict:
    import redis

    c = redis.Redis(port=port, password=password, socket_timeout=5)
    try:
        mem, stats = c.info("memory"), c.info("stats")
        return {"used_memory": mem["used_memory"], "used_memory_rss": mem["used_memory_rss"],
                "maxmemory": mem["maxmemory"], "evicted_keys": stats["evicted_keys"],
                "keys": c.dbsize()}
    finally:
        c.close()


def soak(seconds: float = 300.0, workers: int = 2, max_memory: str = "1GiB",
         tokens: int = 2000, sample_every: float = 10.0, echo: bool = False) -> dict:
    """Redis's memory after `seconds` of unique prompts, with its cap and what was written."""
    from kvyard.common.models import DEMO_SERVED_NAME
    from kvyard.stack.state import StackState
    from kvyard.workers.server.cli import parse_size

    rd = Path(tempfile.mkdtemp(prefix="kvyard-soak-"))
    up = kvyard("up", "--workers", str(workers), "--kv-redis", "--kv-redis-max-memory",
                max_memory, "--port", "0", "--run-dir", str(rd))
    if up.returncode != 0:
        raise RuntimeError(f"kvyard up failed: {up.stdout + up.stderr}")
    try:
        state = StackState.load(rd)
        rport = next(x for x in state.procs if x.name == "redis").ports["redis"]
        password = (rd / "redis.password").read_text().strip()
        url = state.gateway_url + "/v1/completions"
        # calibrate words per token on the worker's own tokenizer
        probe = prompt(random.Random(0), 1000)
        n = len(post(f"http://{state.endpoints[0]}/tokenize",
                     {"model": DEMO_SERVED_NAME, "prompt": probe})["tokens"])
        words = max(1, round(1000 * tokens / n))
        done = {"requests": 0, "errors": 0, "prompt_tokens": 0}
        lock = threading.Lock()
        end = time.monotonic() + seconds

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                try:
                    out = post(url, {"model": DEMO_SERVED_NAME, "max_tokens": 1,
                                     "prompt": prompt(rng, words)})
                    with lock:
                        done["requests"] += 1
                        done["prompt_tokens"] += out["usage"]["prompt_tokens"]
                except Exception:  # noqa: BLE001 - counted; the soak goes on
                    with lock:
                        done["errors"] += 1
        threads = [threading.Thread(target=client, args=(os.getpid() * 100 + i,), daemon=True)
                   for i in range(workers)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        samples = []
        while any(t.is_alive() for t in threads):
            s = redis_info(rport, password) | {"t": round(time.monotonic() - t0, 1),
                                                "load": os.getloadavg()[0]}
            samples.append(s)
            if echo:
                print(f"t={s['t']:6.1f}s used_memory={s['used_memory'] / 2**20:8.1f} MiB "
                      f"rss={s['used_memory_rss'] / 2**20:8.1f} MiB keys={s['keys']:6d} "
                      f"evicted={s['evicted_keys']:7d} requests={done['requests']} "
                      f"load={s['load']:.1f}", file=sys.stderr, flush=True)
            for t in threads:
                t.join(timeout=sample_every / max(1, len(threads)))
        final = redis_info(rport, password)
        st = json.loads(kvyard("status", "--json", "--run-dir", str(rd)).stdout or "{}")
        return {"seconds": seconds, "workers": workers, "prompt_tokens_each":
                done["prompt_tokens"] // max(1, done["requests"]), **done,
                "cap_bytes": parse_size(max_memory), "final": final,
                "peak_used_memory": max(s["used_memory"] for s in samples + [final]),
                "written_to_redis_bytes": written_to_redis(state.endpoints),
                "kvstore": [e.get("kvstore") for e in st.get("endpoints", [])]}
    finally:
        kvyard("down", "--run-dir", str(rd))
        shutil.rmtree(rd, ignore_errors=True)
