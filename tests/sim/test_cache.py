"""The simulated pod's KV blocks: prefix hits with the engine's hashes, LRU eviction at
capacity, blocks returned after each request; and the batching engine over them."""
from __future__ import annotations

import asyncio

import aiohttp

from kvyard.common import kv_events
from kvyard.common.hashing import block_hashes
from kvyard.epp.pool.metrics_parse import parse_vllm_metrics
from kvyard.sim.cache import BlockPool, SeqBlocks
from kvyard.sim.engine import SimEngine, SimRequest
from kvyard.sim.latency import LatencyModel
from kvyard.sim.profiles import load_profile


def test_hits_use_the_engines_block_hashes() -> None:
    events: list[dict] = []
    pool = BlockPool(64, 16, on_event=events.append)
    ids = list(range(100, 150))          # 3 full blocks + 2 tokens
    a = SeqBlocks()
    assert pool.acquire(ids, a) == 0
    pool.register(ids, a)
    assert events[0]["type"] == "BlockStored"
    assert events[0]["block_hashes"] == [kv_events.external_hash(h)
                                         for h in block_hashes(ids, 16)]
    assert events[0]["parent_block_hash"] is None and events[0]["token_ids"] == ids[:48]
    pool.release(a)
    assert pool.usage == 0.0 and len(pool.lru) == 3

    b = SeqBlocks()
    assert pool.acquire(ids, b) == 48     # the whole cached prefix
    assert (pool.prefix_queries_tokens, pool.prefix_hits_tokens) == (100, 48)
    c = SeqBlocks()
    assert pool.acquire(ids[:48], c) == 32  # one token short of the whole sequence
    pool.release(b)
    pool.release(c)
    assert pool.usage == 0.0


def test_lru_eviction_at_capacity() -> None:
    events: list[dict] = []
    pool = BlockPool(4, 16, on_event=events.append)
    prompts = [[p * 1000 + t for t in range(32)] for p in range(3)]  # 2 blocks each
    for ids in prompts[:2]:
        s = SeqBlocks()
        assert pool.acquire(ids, s) is not None
        pool.register(ids, s)
        pool.release(s)
    assert pool.free == 0 and len(pool.lru) == 4
    events.clear()
    s = SeqBlocks()
    assert pool.acquire(prompts[2], s) == 0
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    first = [kv_events.external_hash(h) for h in block_hashes(prompts[0], 16)]
    # the least recently used prompt goes, its tail first (released tail first)
    assert removed and removed[0]["block_hashes"] == first[::-1]
    assert all(h in pool.lru for h in block_hashes(prompts[1], 16))
    big = SeqBlocks()
    assert pool.acquire(list(range(5 * 16)), big) is None  # more than the pool: refused
    pool.release(s)


async def test_repeated_prompt_moves_the_hit_counters(start_pods) -> None:
    prompt = "A shared system prompt that spans several blocks of tokens. " * 6
    async with start_pods(1) as g, aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        cached = []
        for _ in range(2):
            async with s.post(base + "/v1/completions",
                              json={"prompt": prompt, "max_tokens": 2}) as r:
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        async with s.get(base + "/metrics") as r:
            text = await r.text()
    assert cached[0] == 0 and cached[1] >= 16
    hits = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total"))
    assert hits == cached[1]
    assert parse_vllm_metrics(text).kv_usage == 0.0


async def test_batching_respects_max_num_seqs_and_preempts_when_short() -> None:
    prof = load_profile("h200")
    pool = BlockPool(6, 16)
    eng = SimEngine(pool, LatencyModel(prof, time_scale=1000.0, seed=0), max_num_seqs=2,
                    filler=[7, 8, 9], min_step_s=0.0)
    reqs = [SimRequest(f"r{i}", [i * 100 + t for t in range(20)], max_tokens=30)
            for i in range(4)]
    for r in reqs:
        eng.submit(r)
    peak = 0
    while not all(r.finished for r in reqs):
        await eng.step()
        eng._drop_aborted()
        peak = max(peak, len(eng.running))
        assert pool.free >= 0
    assert peak == 2
    assert all(r.output_ids[:3] == [7, 8, 9] and len(r.output_ids) == 30 for r in reqs)
    assert eng.counters.preemptions > 0       # 2 x 50 tokens need 8 blocks of the 6
    assert eng.counters.success["length"] == 4
    assert pool.usage == 0.0 and eng.prompt_tokens_pending == 0
    await asyncio.sleep(0)


async def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode() -> None:
    prof = load_profile("h200")
    eng = SimEngine(BlockPool(256, 16), LatencyModel(prof, time_scale=1000.0, seed=0),
                    max_num_seqs=8, filler=[5], min_step_s=0.0, max_num_batched_tokens=64)
    short = SimRequest("short", list(range(10)), max_tokens=50)
    eng.submit(short)
    await eng.step()                       # short's prefill: its first token
    assert short.prefilled and len(short.output_ids) == 1
    long = SimRequest("long", [1000 + t for t in range(300)], max_tokens=2)
    eng.submit(long)
    steps = 0
    while not long.prefilled:
        before = len(short.output_ids)
        await eng.step()
        steps += 1
        assert len(short.output_ids) == before + 1  # the decode never waits for the prefill
        assert eng.prompt_tokens_pending == long.prefill_left
    assert steps == -(-300 // 63)            # 63 prompt tokens a step beside one decode
    m = eng.model
    assert m.prefill_mean(63, overhead=False) < m.prefill_mean(63)  # overhead once a prompt
