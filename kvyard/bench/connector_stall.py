"""`kvyard bench connector --stall`: what a kvstore hit costs the streams already
decoding (the load runs on the engine's loader thread, kv_loads.py) against the
same prompt computed from scratch by the same engine with no store, same run.

A DRAM-less connector over a real redis-server (or an SSD directory) holds the
blocks of one long prompt, written by an engine that computed it. Per round and
mode, a fresh engine on the demo model (its own prefix cache empty) decodes
`--stall-streams` short requests; after a few steps the long prompt arrives, and the
run goes on until its first token. Per step: its wall time, and whether the
long request was still loading. A running stream's TPOT in a step is that
step's time (every stream decodes one token per step). Rows: TPOT p50 before the
arrival, p50 and worst while the hit is in flight (arrival to its first token,
or, for `recompute`, the steps that prefill it), the load's own time, the long
request's TTFT. Modes (`hit`, `recompute`) interleave, order alternating per round.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank. "


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--stall")
    g.add_argument("--stall", action="store_true",
                   help="the streams' TPOT while a kvstore hit loads (CPU, demo model)")
    g.add_argument("--stall-tokens", type=int, default=2048, help="the hit's prompt tokens")
    g.add_argument("--stall-tier", choices=("redis", "ssd"), default="redis")
    g.add_argument("--stall-streams", type=int, default=4, help="requests decoding meanwhile")
    g.add_argument("--stall-dtype", default="auto")
    g.add_argument("--stall-device", default="cpu", help="cpu | cuda (the engine's)")
    g.add_argument("--stall-rounds", type=int, default=3)
    g.add_argument("--stall-threads", type=int, default=None,
                   help="the engine's torch threads (default: all cores)")


def _engine(model, mcfg, tok, connector, dtype: str, max_len: int, threads: int | None):
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model="demo", dtype=dtype, device=str(model.device),
                       kv_cache_memory_bytes=1 << 30,
                       max_model_len=max_len, max_num_batched_tokens=4096,
                       kv_connector=connector, num_threads=threads)
    return LLMEngine(cfg, model, mcfg, tok)


HIT = 4  # tokens the hit generates: checked against the engine that computed its prompt


def _round(mode: str, make, long_ids, short_ids, streams: int) -> dict:
    from kvyard.workers.engine.api import SamplingParams

    conn, eng = make(mode == "hit")
    timed = {"load_s": 0.0}
    if conn is not None:
        load = conn.load

        def timed_load(h, b):
            t0 = time.perf_counter()
            try:
                return load(h, b)
            finally:
                timed["load_s"] += time.perf_counter() - t0
        conn.load = timed_load
    run = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(streams):
        eng.add_request(f"s{i}", short_ids[i], run)
    before: list[float] = []
    during: list[float] = []
    steps = 0
    t_arrive = ttft = None
    hit: list[int] = []
    while len(hit) < HIT:
        if steps == 12:
            eng.add_request("hit", long_ids, SamplingParams(temperature=0.0, max_tokens=HIT,
                                                            ignore_eos=True))
            t_arrive = time.perf_counter()
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        steps += 1
        for o in outs:
            if o.request_id == "hit":
                hit += o.new_token_ids
        if t_arrive is None:
            if steps > 4:                    # past the short prompts' prefill
                before.append(dt)
        elif ttft is None:
            during.append(dt)
            if hit:
                ttft = time.perf_counter() - t_arrive
    eng.abort_all()
    if conn is not None:
        conn.close()
    return {"before": before, "during": during, "load_s": timed["load_s"], "ttft_s": ttft,
            "loaded": conn.loaded_blocks if conn is not None else 0, "tokens": hit}


def run_stall(args: argparse.Namespace) -> int:
    import json

    from kvyard.bench.report import Report
    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.kvstore import StoreConfig
    from kvyard.kvstore.redis_server import RedisServer
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.model_runner import resolve_device, resolve_dtype
    from kvyard.workers.kvconnector import StoreConnector, model_identity_of
    from kvyard.workers.model import load_model

    max_len = args.stall_tokens + 64
    device = resolve_device(args.stall_device)
    model, mcfg = load_model(resolve_model("demo"), resolve_dtype(args.stall_dtype, device),
                             max_len, device=device)
    tok = load_tokenizer("demo")
    ids = tok.encode(TEXT * (args.stall_tokens // 10 + 1), add_special_tokens=False)
    long_ids = ids[:args.stall_tokens]
    short_ids = [tok.encode(f"Story number {i}: once upon a time", add_special_tokens=False)
                 for i in range(args.stall_streams)]
    ident = model_identity_of("demo")
    redis = RedisServer(max_memory_bytes=2 << 30).start() if args.stall_tier == "redis" else None
    ssd = tempfile.TemporaryDirectory(prefix="kvyard-stall-")
    try:
        cfg = StoreConfig(redis_url=redis.url, redis_password=redis.password) if redis else \
            StoreConfig(ssd_dir=ssd.name, ssd_bytes=4 << 30)
        first = StoreConnector(cfg, ident)
        writer = _engine(model, mcfg, tok, first, args.stall_dtype, max_len, args.stall_threads)
        want = LLM(engine=writer).generate(
            [long_ids], SamplingParams(temperature=0.0, max_tokens=HIT, ignore_eos=True))[0].token_ids
        assert first.store.flush(60), "the store did not take the prompt's blocks"
        first.close()

        def make(with_store: bool):
            c = StoreConnector(cfg, ident) if with_store else None
            return c, _engine(model, mcfg, tok, c, args.stall_dtype, max_len, args.stall_threads)
        res: dict[str, list[dict]] = {"hit": [], "recompute": []}
        for r in range(args.stall_rounds):
            for mode in (("hit", "recompute") if r % 2 == 0 else ("recompute", "hit")):
                res[mode].append(_round(mode, make, long_ids, short_ids, args.stall_streams))
    finally:
        if redis is not None:
            redis.stop()
        ssd.cleanup()
    blocks = res["hit"][0]["loaded"]
    nbytes = blocks * first.layout.nbytes
    report = Report(f"running streams' TPOT while a {args.stall_tier} hit of "
                    f"{args.stall_tokens} tokens ({blocks} blocks, {nbytes / 1e6:.0f} MB) loads: "
                    f"{args.stall_streams} streams, demo model {str(writer.dtype).removeprefix('torch.')} "
                    f"on {device.type}, "
                    f"{args.stall_rounds} interleaved rounds",
                    ["mode", "tpot_before_ms", "tpot_during_p50_ms", "tpot_during_max_ms",
                     "load_ms", "hit_ttft_ms", "blocks_loaded", "same_tokens"])
    def ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3
    for mode, rounds in res.items():
        report.add(mode=mode,
                   tpot_before_ms=ms([statistics.median(r["before"]) for r in rounds]),
                   tpot_during_p50_ms=ms([statistics.median(r["during"]) for r in rounds]),
                   tpot_during_max_ms=ms([max(r["during"]) for r in rounds]),
                   load_ms=ms([r["load_s"] for r in rounds]),
                   hit_ttft_ms=ms([r["ttft_s"] for r in rounds]),
                   blocks_loaded=rounds[0]["loaded"],
                   same_tokens=all(r["tokens"] == want for r in rounds))
    report.meta["during_steps_ms"] = {m: [[round(x * 1e3, 1) for x in r["during"]] for r in rounds]
                                      for m, rounds in res.items()}
    report.notes.append(
        "medians over rounds; tpot = one engine step's wall time (each stream decodes a token "
        "per step); during = from the long prompt's arrival to its first token; hit = its blocks "
        "loaded from the store on the loader thread, recompute = the same engine without a store "
        "prefills it; same_tokens: the hit's greedy tokens equal those of the engine that computed its prompt")
    if args.json:
        print(json.dumps(report.to_json(), indent=2), flush=True)
    else:
        report.emit(False)
    return 0
