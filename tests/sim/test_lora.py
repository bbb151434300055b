"""Simulated LoRA adapters: an adapter is a `model`; `--max-loras` active at once (LRU), a
load costs simulated time, `vllm:lora_requests_info` as vLLM writes it (and the EPP's
parser reads it), `/v1/models` with `parent`, adapters never share KV blocks."""
from __future__ import annotations

import aiohttp

from kvyard.epp.pool.metrics_parse import parse_vllm_metrics
from kvyard.sim.lora import AdapterSlots, parse_lora_modules

MODULES = {"a1": "/ad/a1", "a2": "/ad/a2", "a3": "/ad/a3"}


def test_slots_lru_and_busy_adapters_are_never_evicted() -> None:
    s = AdapterSlots(dict(MODULES), max_loras=2, load_s=0.25)
    assert s.acquire("a1", set()) == 0.25 and s.acquire("a2", set()) == 0.25
    assert s.acquire("a1", set()) == 0.0          # active: free; and now the most recent
    assert s.acquire("a3", {"a2"}) == 0.25        # evicts a1? no: a2 is busy, a1 idle
    assert list(s.active) == ["a2", "a3"] and s.loads == 3 and s.evictions == 1
    assert s.acquire("a1", {"a2", "a3"}) is None  # both slots in use: wait
    assert parse_lora_modules(["x=/p y"]) == {"x": "/p", "y": "y"}


async def test_adapter_requests_listing_metric_and_load_cost(start_pods, tok) -> None:
    async with start_pods(1, lora_modules=dict(MODULES), max_loras=1,
                          lora_load_s=2.0) as g, aiohttp.ClientSession() as s:
        pod = g.pods[0]
        base = f"http://{pod.address}"
        async with s.get(base + "/v1/models") as r:
            listed = {m["id"]: m for m in (await r.json())["data"]}
        assert listed["a2"]["parent"] == tok.name and listed["a2"]["root"] == "/ad/a2"
        assert listed[tok.name]["parent"] is None
        body = {"prompt": "the same prompt for every adapter, long enough for blocks " * 8,
                "max_tokens": 2}
        sims = []
        for model in ("a1", "a1", "a2", tok.name):
            before = pod.engine.sim_time
            async with s.post(base + "/v1/completions", json={**body, "model": model}) as r:
                doc = await r.json()
                assert r.status == 200, doc
            sims.append((pod.engine.sim_time - before, doc["usage"]))
        assert pod.engine.lora.loads == 2                      # a1 once, a2 once
        assert sims[0][0] >= 2.0 and sims[1][0] < 2.0 and sims[2][0] >= 2.0
        # a1's second request hits a1's blocks; a2 and the base share none of them
        cached = [u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for _, u in sims]
        assert cached[1] > 0 and cached[2] == 0 and cached[3] == 0
        async with s.post(base + "/v1/completions", json={**body, "model": "nope"}) as r:
            assert r.status == 404
        async with s.get(base + "/metrics") as r:
            text = await r.text()
        m = parse_vllm_metrics(text)
        assert m.max_lora == 1 and m.lora_running == frozenset() and m.seen > 0


def test_parser_reads_the_newest_lora_series() -> None:
    text = ('vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
            'waiting_lora_adapters="c"} 1.7e9\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",'
            'waiting_lora_adapters=""} 1.6e9\n'
            'vllm:num_requests_running{model_name="m"} 2\n')
    m = parse_vllm_metrics(text)
    assert (m.lora_running, m.lora_waiting, m.max_lora) == (frozenset("ab"), frozenset("c"), 4)
    assert parse_vllm_metrics('vllm:num_requests_running{model_name="m"} 2\n').lora_running is None


def test_an_adapters_blocks_are_stored_under_its_name() -> None:
    from kvyard.common.hashing import adapter_seed
    from kvyard.sim.cache import BlockPool, SeqBlocks

    events: list[dict] = []
    pool = BlockPool(64, 4, on_event=events.append)
    ids = list(range(1, 14))
    base, lora = SeqBlocks(), SeqBlocks(seed=adapter_seed("a1"), lora_name="a1")
    for seq in (base, lora):
        assert pool.acquire(ids, seq) == 0   # never the other's blocks
        pool.register(ids, seq)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert [e["lora_name"] for e in stored] == [None, "a1"]
    assert set(stored[0]["block_hashes"]).isdisjoint(stored[1]["block_hashes"])
