"""Precise prefix routing against a real worker on the demo model: the EPP subscribes
to the worker's KV events (the default topic, vLLM's frames) and its precise scorer
then matches, on that endpoint, every full block of a completions prompt and of a
chat prompt, tokenized by the EPP exactly as the worker tokenized them."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.epp.kvevents.index import KVBlockIndex
from kvyard.epp.kvevents.sources import KVEventSources
from kvyard.epp.pool.endpoints import Endpoint, EndpointPool, EndpointSpec
from kvyard.epp.prompt import PromptHasher
from kvyard.epp.request import parse_request
from kvyard.epp.scheduling.config import build_scheduler
from kvyard.epp.scheduling.cycle import PREFIX_MATCHES
from kvyard.epp.scheduling.types import SchedRequest
from kvyard.workers.server.testing import free_port, start_worker

BS = 16


def _post(base: str, path: str, doc: dict) -> dict:
    req = urllib.request.Request(base + path, json.dumps(doc).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    pub, rep = free_port(), free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}"})
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len", "1024",
                      "--kv-cache-memory-bytes", "64MiB", "--num-threads", "1",
                      "--kv-events-config", cfg],
                     tmp_path_factory.mktemp("w") / "w.log")
    yield w, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"
    w.stop()


async def test_the_precise_scorer_matches_what_the_worker_cached(worker) -> None:
    from kvyard.common.tokenizer import ChatTemplateError, load_tokenizer

    w, pub, rep = worker
    addr = f"127.0.0.1:{w.port}"
    sched = build_scheduler({"scorers": [{"type": "precise-prefix-cache", "weight": 1,
                                          "speculativeTTL": 0.0}]})
    scorer = sched.scorers[0][0]
    pool = EndpointPool()
    pool.set_source("static", [EndpointSpec(addr, kv_events=pub, kv_replay=rep)])
    src = KVEventSources(scorer.index, pool)
    src.sync()
    hasher = PromptHasher(block_size=64, chunk_chars=256)
    hasher.set_tokenizer(load_tokenizer("demo"), ChatTemplateError)
    other = Endpoint("127.0.0.1:1")
    text = "Tell me about the rivers of France and the towns along them. " * 12
    msgs = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Which river runs through Lyon? " * 10}]
    cases = [("/v1/completions", {"prompt": text}),
             ("/v1/chat/completions", {"messages": msgs})]
    try:
        for path, body in cases:
            doc = {"model": DEMO_SERVED_NAME, **body}
            await asyncio.to_thread(_post, w.base_url, path,
                                    {**doc, "max_tokens": 1, "temperature": 0})
            n_tokens = (await asyncio.to_thread(_post, w.base_url, "/tokenize", doc))["count"]
            want = n_tokens // BS
            parsed = parse_request(json.dumps(doc).encode(), path, {}, None)

            def score() -> tuple[float, SchedRequest]:
                req = SchedRequest(DEMO_SERVED_NAME, hasher.prompt(parsed))
                return scorer.score(req, [Endpoint(addr), other])[0], req
            deadline = time.monotonic() + 60
            while score()[0] < 1.0:
                assert time.monotonic() < deadline, (path, score()[0], src.snapshot())
                await asyncio.sleep(0.05)  # a poll interval under a deadline
            got, req = score()
            assert scorer.index.block_size[addr] == BS
            assert req.cycle.read(PREFIX_MATCHES)[addr] == want * BS // 64
            assert len(scorer._keys(req, BS).keys) >= want
        (sub,) = src.subs.values()
        assert sub.topic == f"kv@{addr}@{DEMO_SERVED_NAME}"
        assert sub.lost == 0 and sub.bad == 0
        # a second EPP subscribing now (an EPP restart, a new replica): no new batch comes,
        # the replay socket alone brings it to the same index
        late = KVEventSources(KVBlockIndex(), pool)
        late.sync()
        try:
            deadline = time.monotonic() + 30
            while late.index.blocks.keys() != scorer.index.blocks.keys():
                assert time.monotonic() < deadline, late.snapshot()
                await asyncio.sleep(0.05)  # a poll interval under a deadline
            assert len(late.index.blocks) >= want
            # the replay's frames carry the topic (vLLM >= 0.26)
            assert next(iter(late.subs.values())).topic == f"kv@{addr}@{DEMO_SERVED_NAME}"
        finally:
            await late.close()
    finally:
        await src.close()


async def test_the_epp_routes_to_what_a_worker_cached_behind_its_back(worker, fake_vllm,
                                                                      epp, xp) -> None:
    """The whole EPP (ext_proc, precise example config): a prompt the worker cached for
    someone else (not through this EPP, so no belief could know) draws the next request
    with that prefix to the worker, away from an idle endpoint without events."""
    from pathlib import Path

    import kvyard.epp

    w, pub, rep = worker
    addr = f"127.0.0.1:{w.port}"
    idle = await fake_vllm()
    config = str(Path(kvyard.epp.__file__).parent / "scheduler.precise.example.yaml")
    app = await epp([EndpointSpec(addr, kv_events=pub, kv_replay=rep), EndpointSpec(idle.address)],
                    model="demo", served_model_names=[], config=config, seed=3)
    await xp.wait_for(app.is_ready, timeout=60, what="tokenizer and endpoints")
    system = "You are a geography tutor. " + "Rivers: Seine, Loire, Rhone, Garonne. " * 20
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Paris?"}]
    await asyncio.to_thread(_post, w.base_url, "/v1/chat/completions",
                            {"model": DEMO_SERVED_NAME, "messages": msgs, "max_tokens": 1})
    idx = app.kv_events.index
    await xp.wait_for(lambda: idx.size(addr) >= 20, timeout=30, what="the worker's events")
    body = {"model": DEMO_SERVED_NAME,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Lyon?"}]}
    r = await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(xp.chat_headers()),
                                                  xp.body_msg(json.dumps(body).encode())])
    assert xp.set_headers(r[0])["x-gateway-destination-endpoint"] == addr
    assert app.metrics.registry.get_sample_value("kvyard_epp_prefix_matched_blocks_total") > 0
    assert app._debug()["kv_events"]["streams"][0]["last_seq"] is not None
