"""KV events from a simulated pod, read as a router reads them: a real ZMQ SUB and the
decoder in kvyard.common.kv_events, and a replay asked on the ROUTER socket."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import zmq
import zmq.asyncio

from kvyard.common import kv_events
from kvyard.common.hashing import block_hashes
from kvyard.common.kv_events import KVEventsConfig


def _config(pub: int, replay: int) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                          endpoint=f"tcp://127.0.0.1:{pub}",
                          replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="kv@{address}@{model}")


async def test_block_stored_on_a_sub_socket_and_replayed(start_pods, free_port, tok) -> None:
    pub_port, replay_port = free_port(), free_port()
    # the pod connects its PUB (no wildcard); the subscriber binds, as llm-d's listener does
    ctx = zmq.asyncio.Context()  # the pods share this event loop: never block it
    sub = ctx.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        async with start_pods(1, kv_events=lambda i: _config(pub_port, replay_port)) as g, \
                aiohttp.ClientSession() as s:
            pod = g.pods[0]
            base = f"http://{pod.address}"
            topic = f"kv@{pod.address}@{tok.name}".encode()
            got = None
            deadline = time.monotonic() + 20
            n = 0
            while got is None and time.monotonic() < deadline:  # PUB drops until SUB joined
                prompt = f"prompt number {n}: " + "tokens in full blocks " * 8
                n += 1
                async with s.post(base + "/v1/completions",
                                  json={"prompt": prompt, "max_tokens": 1}) as r:
                    assert r.status == 200
                try:
                    got = (await asyncio.wait_for(sub.recv_multipart(), 0.2), prompt)
                except asyncio.TimeoutError:
                    pass
            assert got is not None, "no KV event arrived"
            (t, seq, payload), prompt = got
            assert t == topic and len(seq) == 8
            _, events = kv_events.decode_batch(payload)
            stored = [e for e in events if e["type"] == "BlockStored"]
            ids = tok.encode(prompt, add_special_tokens=True)
            want = [kv_events.external_hash(h) for h in block_hashes(ids, 16)]
            assert stored[0]["block_hashes"] == want[:len(stored[0]["block_hashes"])]
            assert stored[0]["block_size"] == 16 and stored[0]["medium"] == "GPU"
            assert stored[0]["token_ids"] == ids[:16 * len(stored[0]["block_hashes"])]

            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{replay_port}")
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replies = []
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
                assert frames[0] == b"" and frames[1] == topic  # vLLM >= 0.26: with the topic
                if frames[2] == kv_events.END_SEQ:
                    break
                replies.append((int.from_bytes(frames[2], "big"), frames[3]))
            dealer.close(linger=0)
            assert [q for q, _ in replies] == list(range(len(replies))) and len(replies) >= n
            assert any(p == payload for _, p in replies)
    finally:
        sub.close(linger=0)
        ctx.term()
