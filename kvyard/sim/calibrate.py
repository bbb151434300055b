"""Measure a real CPU worker and write a latency profile for the simulator (`--profile FILE`).

Starts `kvyard worker` (kvyard.bench.servers), then over its HTTP API, with the streaming
client every bench uses (kvyard.bench.client):
- TTFT against prompt length: fresh random token-id prompts (no prefix hit) of each
  `--prompt-lens` length, `max_tokens` 1, one at a time, `--repeats` each; a least-squares
  line gives prefill_overhead (intercept) and prefill_time_per_token (slope), the
  residuals' standard deviation the prefill jitter;
- ITL against batch: `c` concurrent streams of `--decode-tokens` tokens for each
  `--concurrency` level; the median ITL at the lowest level is inter_token_latency, the
  slope to the highest itl_per_running_seq, the ITLs' spread at the lowest the ITL jitter.
P/D transfer times are not measured (no peer): they stay the base profile's.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--prompt-lens", default="16,256,1024", help="comma-separated token counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", default="1,4", help="comma-separated stream counts")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--base", default="cpu-demo", help="profile whose other fields are kept")
    p.add_argument("--name", default="cpu-demo")
    p.add_argument("--out", type=Path, default=Path("sim-profile.json"))
    p.add_argument("--url", default=None,
                   help="measure a worker already running there instead of starting one")


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(intercept, slope, residual std) of the least-squares line."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    icpt = my - slope * mx
    res = [y - (icpt + slope * x) for x, y in zip(xs, ys)]
    return icpt, slope, statistics.pstdev(res) if len(res) > 1 else 0.0


async def _measure(url: str, lens: list[int], repeats: int, levels: list[int], n_out: int
                   ) -> tuple[list[tuple[int, float]], dict[int, list[float]]]:
    import asyncio

    import aiohttp

    from kvyard.bench.client import completion_body, stream

    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    ttfts: list[tuple[int, float]] = []
    itls: dict[int, list[float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        await stream(s, url, completion_body(None, prompt(8), 2))  # warm-up
        for n in lens:
            for _ in range(repeats):
                r = await stream(s, url, completion_body(None, prompt(n), 1))
                if not r.ok:
                    raise RuntimeError(f"TTFT request failed: {r.error}")
                ttfts.append((n, r.ttft_s))
        for c in levels:
            rs = await asyncio.gather(*(stream(s, url, completion_body(None, prompt(16), n_out))
                                        for _ in range(c)))
            bad = [r.error for r in rs if not r.ok]
            if bad:
                raise RuntimeError(f"ITL request failed: {bad[0]}")
            itls[c] = [x for r in rs for x in r.itl_s]
    return ttfts, itls


def profile_from(base, ttfts: list[tuple[int, float]], itls: dict[int, list[float]], name: str,
                 source: str):
    from kvyard.sim.profiles import LatencyProfile

    icpt, slope, res = fit_line([float(n) for n, _ in ttfts], [t for _, t in ttfts])
    lo, hi = min(itls), max(itls)
    itl_lo = statistics.median(itls[lo])
    per_seq = (statistics.median(itls[hi]) - itl_lo) / (hi - lo) if hi > lo else 0.0
    doc = base.to_json()
    doc.update(name=name, prefill_overhead=max(0.0, icpt), prefill_time_per_token=max(0.0, slope),
               prefill_time_std_dev=res, inter_token_latency=itl_lo,
               itl_per_running_seq=max(0.0, per_seq),
               inter_token_latency_std_dev=statistics.pstdev(itls[lo]) if len(itls[lo]) > 1
               else 0.0, source=source)
    return LatencyProfile.from_json(doc)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import socket

    from kvyard.sim.profiles import load_profile

    lens = [int(x) for x in args.prompt_lens.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    base = load_profile(args.base)
    server = None
    url = args.url
    if url is None:
        from kvyard.bench import servers

        extra = ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs)]
        if args.dtype:
            extra += ["--dtype", args.dtype]
        server = servers.worker(extra, name="calibrate").start()
        url = server.base_url
    try:
        ttfts, itls = asyncio.run(_measure(url, lens, args.repeats, levels, args.decode_tokens))
    except RuntimeError as e:
        print(f"kvyard sim calibrate: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    prof = profile_from(base, ttfts, itls, args.name,
                        f"kvyard sim calibrate: kvyard worker --model {args.model} on "
                        f"{socket.gethostname()}, {when}; P/D transfer from {base.name}")
    prof.save(args.out)
    print(json.dumps(prof.to_json(), indent=2))
    print(f"wrote {args.out} (use: kvyard sim serve --profile {args.out})")
    return 0
