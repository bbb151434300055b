"""What peer routers read from a simulated pod besides generation: vLLM's /tokenize and
/v1/completions/render (vllm-router keys requests by these ids), and KV events in newer
vLLM's form, a positional batch of maps tagged "type" (vllm-router's kv_aware)."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from kvyard.common import kv_events
from kvyard.common.kv_events import KVEventsConfig


async def test_tokenize_and_render_give_the_ids_the_pod_prefills(start_pods, tok) -> None:
    prompt = "the same ids as a generate request " * 4
    want = tok.encode(prompt, add_special_tokens=True)
    async with start_pods(1) as g, aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        async with s.post(base + "/tokenize", json={"prompt": prompt}) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["tokens"] == want and doc["count"] == len(want) and doc["max_model_len"] > 0
        async with s.post(base + "/v1/completions/render",
                          json={"prompt": prompt, "max_tokens": 4}) as r:
            assert r.status == 200
            assert await r.json() == [{"token_ids": want}]
        async with s.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
            assert (await r.json())["usage"]["prompt_tokens"] == len(want)
        async with s.post(base + "/v1/completions/render", json={"prompt": ""}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        async with s.post(base + "/tokenize", json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404


def test_tagged_map_events_decode_as_the_positional_ones() -> None:
    ev = kv_events.block_stored([1, 2], None, list(range(32)), 16)
    gone = kv_events.block_removed([2])
    maps = kv_events.encode_batch(1.5, [ev, gone, kv_events.all_blocks_cleared()], 3,
                                  tagged_maps=True)
    raw = msgpack.unpackb(maps)
    assert raw[0] == 1.5 and raw[2] == 3 and isinstance(raw[1][0], dict)
    assert raw[1][0]["type"] == "BlockStored" and raw[1][2] == {"type": "AllBlocksCleared"}
    arrays = kv_events.encode_batch(1.5, [ev, gone, kv_events.all_blocks_cleared()], 3)
    assert isinstance(msgpack.unpackb(arrays)[1][0], list)
    assert kv_events.decode_event_batch(maps) == kv_events.decode_event_batch(arrays)


async def test_a_pod_publishes_tagged_map_events_when_asked(start_pods, free_port) -> None:
    pub_port = free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                         endpoint=f"tcp://127.0.0.1:{pub_port}")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        async with start_pods(1, kv_events=lambda i: cfg, event_maps=True) as g, \
                aiohttp.ClientSession() as s:
            base = f"http://{g.pods[0].address}"
            payload, deadline, n = None, time.monotonic() + 20, 0
            while payload is None and time.monotonic() < deadline:  # PUB drops until joined
                n += 1
                async with s.post(base + "/v1/completions",
                                  json={"prompt": f"{n} " + "full blocks " * 20,
                                        "max_tokens": 1}) as r:
                    assert r.status == 200
                try:
                    payload = (await asyncio.wait_for(sub.recv_multipart(), 0.2))[2]
                except asyncio.TimeoutError:
                    pass
            assert payload is not None, "no KV event arrived"
            batch = msgpack.unpackb(payload)
            assert isinstance(batch, list) and batch[1]
            assert all(isinstance(e, dict) and e["type"] in ("BlockStored", "BlockRemoved")
                       for e in batch[1])
            stored = next(e for e in kv_events.decode_batch(payload)[1]
                          if e["type"] == "BlockStored")
            assert stored["block_size"] == 16 and len(stored["token_ids"]) % 16 == 0
    finally:
        sub.close(linger=0)
        ctx.term()
