"""The precise prefix index and scorer, fed with KV events as vLLM and kvyard encode
them (map and array form), without sockets: own keys from token ids, removals through
the engine-key map, unknown parents kept, AllBlocksCleared, mediums, the memory
budget (measured), speculative picks, data-parallel ranks and the request side's BOS."""
from __future__ import annotations

import json
import random
import tracemalloc
from array import array

import msgpack

from kvyard.common import kv_events as kve
from kvyard.common.hashing import block_hashes
from kvyard.epp.kvevents.index import BLOCK_BYTES, HOLDER_BYTES, KVBlockIndex
from kvyard.epp.kvevents.request_keys import EngineKeys
from kvyard.epp.kvevents.speculative import Speculative
from kvyard.epp.pool.endpoints import Endpoint
from kvyard.epp.prompt import LazyPrompt, PromptHasher
from kvyard.epp.request import parse_request
from kvyard.epp.scheduling.config import build_scheduler
from kvyard.epp.scheduling.cycle import PREFIX_MATCHES
from kvyard.epp.scheduling.scorers.precise_prefix import PrecisePrefixScorer
from kvyard.epp.scheduling.types import SchedRequest

BS = 16
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def _engine_keys(tokens: list[int], salt: int) -> list[int]:
    """An engine's own hashes: any function of the prefix, here a salted one (the index
    must not care)."""
    return [(h ^ salt) & ((1 << 64) - 1) for h in block_hashes(tokens, BS, seed=salt)]


def _stored_map(tokens: list[int], salt: int, start: int = 0, end: int | None = None,
                medium: str = "GPU") -> dict:
    keys = _engine_keys(tokens, salt)
    end = len(keys) if end is None else end
    return {"type": "BlockStored", "block_hashes": keys[start:end],
            "parent_block_hash": keys[start - 1] if start else None,
            "token_ids": tokens[start * BS:end * BS], "block_size": BS, "medium": medium}


def _stored_array(ev: dict) -> list:
    """vLLM's positional (array_like, tagged) BlockStored of the same event."""
    return ["BlockStored", ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"],
            ev["block_size"], None, ev["medium"], None, None, 0, "full_attention", None]


def _req(tokens: list[int]) -> SchedRequest:
    return SchedRequest("m", LazyPrompt.of_ids(tokens, 64, 0))


def _matched(scorer: PrecisePrefixScorer, tokens: list[int], *eps: str) -> list[float]:
    return scorer.score(_req(tokens), [Endpoint(a) for a in eps])


def test_map_and_array_events_index_the_same_own_keys_and_the_scorer_walks_them() -> None:
    toks = _tokens(1, 10 * BS + 5)
    scorer = PrecisePrefixScorer(speculative=Speculative(0.0))
    scorer.index.subscribed = {A, B, "10.0.0.3:8000"}
    first = _stored_map(toks, salt=7, end=6)
    rest = _stored_map(toks, salt=99, start=6)  # another engine seed: other keys, same blocks
    payload_a = kve.encode_batch(1.0, [first])
    payload_b = msgpack.packb([2.0, [_stored_array(rest)], 0])  # array form, positional
    scorer.index.apply(A, kve.decode_event_batch(payload_a).events)
    scorer.index.apply(B, kve.decode_event_batch(payload_a).events)
    # B's continuation names a parent engine key it never announced under salt 99: kept
    scorer.index.apply(B, kve.decode_event_batch(payload_b).events)
    assert scorer.index.snapshot()["orphans"] == {B: 4}
    req = _req(toks)
    got = scorer.score(req, [Endpoint(A), Endpoint(B), Endpoint("10.0.0.3:8000")])
    assert got[0] == 6 / 10 and got[2] == 0.0
    assert req.cycle.read(PREFIX_MATCHES) == {A: 6 * BS // 64, B: 6 * BS // 64,
                                              "10.0.0.3:8000": 0}
    # the parent arrives (e.g. replayed) under B's engine keys: the orphans join the chain
    scorer.index.apply(B, [_stored_map(toks, salt=99, end=6)])
    assert scorer.index.snapshot()["orphans"] == {}
    assert _matched(scorer, toks, A, B) == [6 / 10, 1.0]
    # the walk tokenizes nothing past the prompt: a longer prompt keeps the same match
    assert _matched(scorer, toks + _tokens(2, 64), B)[0] == 10 / 14


def test_removals_mediums_and_clear_follow_the_engine_keys() -> None:
    toks = _tokens(3, 8 * BS)
    scorer = PrecisePrefixScorer()
    idx = scorer.index
    idx.subscribed = {A}
    idx.apply(A, [_stored_map(toks, 5)])
    idx.apply(A, [_stored_map(toks, 5, medium="CPU")])  # offloaded as well
    keys = _engine_keys(toks, 5)
    idx.apply(A, [{"type": "BlockRemoved", "block_hashes": keys[4:], "medium": "GPU"}])
    # blocks 4.. are on CPU only now: they count 0.8
    assert abs(_matched(scorer, toks, A)[0] - (4 + 4 * 0.8) / 8) < 1e-9
    idx.apply(A, [{"type": "BlockRemoved", "block_hashes": keys[2:], "medium": "CPU"}])
    assert _matched(scorer, toks, A) == [4 / 8]  # 2..3 still on GPU, 4.. nowhere
    idx.apply(A, [{"type": "AllBlocksCleared"}])
    assert _matched(scorer, toks, A) == [0.0] and idx.holders == 0 and not idx.blocks


def test_memory_budget_evicts_least_recent_blocks_and_the_estimate_is_measured() -> None:
    idx = KVBlockIndex(max_bytes=100 * (BLOCK_BYTES + HOLDER_BYTES))
    chains = [_tokens(10 + i, 20 * BS) for i in range(10)]
    for i, toks in enumerate(chains):
        idx.apply(A, [_stored_map(toks, 1)])
        assert idx.bytes_used <= idx.max_bytes
    assert len(idx.blocks) == 100 and idx.evicted == 100
    assert idx.size(A) == 100          # the engine-key map shrinks with it
    # measured: what the index really allocates per block is what it charges
    big = KVBlockIndex()
    evs = [_stored_map(_tokens(100 + i, 10 * BS), 3) for i in range(300)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for ev in evs:
            big.store(A, ev)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.6 < used / big.bytes_used < 1.5, (used, big.bytes_used)


def test_own_picks_are_speculative_until_events_arrive() -> None:
    sched = build_scheduler({"scorers": [{"type": "precise-prefix-cache", "weight": 1}]},
                            seed=1)
    toks = _tokens(4, 6 * BS)
    eps = [Endpoint(a) for a in (A, B, "10.0.0.3:8000")]
    scorer = sched.scorers[0][0]
    scorer.index.subscribed = {e.address for e in eps}
    picks = {sched.schedule(_req(toks), eps).endpoint.address for _ in range(20)}
    assert len(picks) == 1              # a burst of one prefix sticks to its first pick
    assert len(scorer.speculative) == 6 and scorer.fallback.index.size(picks.pop()) == 0
    scorer.speculative.purge(float("inf"))
    assert len(scorer.speculative) == 0


def test_endpoints_without_events_are_scored_by_belief_as_today() -> None:
    """Only A publishes: B and C keep the approximate index (fed by the picks)."""
    scorer = PrecisePrefixScorer(speculative=Speculative(0.0))
    scorer.index.subscribed = {A}
    toks = _tokens(6, 8 * 64)
    scorer.index.apply(A, [_stored_map(toks, 1, end=16)])   # A holds half, truly
    scorer.fallback.learn(B, LazyPrompt.of_ids(toks, 64, 0).finish())  # B was sent it all
    got = scorer.score(_req(toks), [Endpoint(A), Endpoint(B), Endpoint("10.0.0.3:8000")])
    assert got == [16 / 32, 1.0, 0.0]


def test_data_parallel_ranks_map_to_their_endpoints() -> None:
    import asyncio

    from kvyard.epp.kvevents.subscriber import Subscription

    idx = KVBlockIndex()
    sub = Subscription(None, "tcp://x:1", None, idx, ranks={0: A, 1: B})  # type: ignore[arg-type]
    toks = _tokens(5, 4 * BS)
    for seq, rank in ((0, 1), (1, 0)):
        payload = kve.encode_batch(0.0, [_stored_map(toks, rank, end=2 + rank)], rank)
        asyncio.run(sub.on_message(seq, payload))
    assert idx.size(A) == 2 and idx.size(B) == 3


class _BosTokenizer:
    """The demo tokenizer made Llama-like: encoding with special tokens adds BOS."""

    def __init__(self, tok, bos: int = 1) -> None:
        self.tok, self.bos = tok, bos

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ([self.bos] if add_special_tokens else []) + self.tok.encode(text)

    def encode_batch(self, texts, add_special_tokens: bool = False):
        return [self.encode(t, add_special_tokens) for t in texts]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt)


def test_request_keys_are_the_workers_tokens_bos_included() -> None:
    from kvyard.common.tokenizer import load_tokenizer

    tok = _BosTokenizer(load_tokenizer("demo"))
    h = PromptHasher(block_size=64, chunk_chars=200)
    h.set_tokenizer(tok, None)
    text = "Rivers of France and their towns, one by one. " * 30
    comp = parse_request(json.dumps({"model": "m", "prompt": text}).encode(),
                         "/v1/completions", {}, ["m"])
    worker = tok.encode(text, add_special_tokens=True)      # what the worker runs
    assert worker[0] == 1
    keys = EngineKeys(h.prompt(comp), BS)
    assert keys.get(0) == block_hashes(worker[:BS], BS)[0]   # lazily: the first chunk only
    assert keys.prompt.tokens < len(worker) - 1
    assert [keys.get(i) for i in range(len(worker) // BS)] == block_hashes(worker, BS)
    msgs = [{"role": "user", "content": text}]
    chat = parse_request(json.dumps({"model": "m", "messages": msgs}).encode(),
                         "/v1/chat/completions", {}, ["m"])
    ids = tok.encode(tok.apply_chat_template(msgs))           # the template's own BOS only
    keys = EngineKeys(h.prompt(chat), BS)
    assert [keys.get(i) for i in range(len(ids) // BS)] == block_hashes(ids, BS)
    ids_prompt = parse_request(json.dumps({"model": "m", "prompt": [5] * 40}).encode(),
                               "/v1/completions", {}, ["m"])
    assert EngineKeys(h.prompt(ids_prompt), BS).known() == block_hashes(array("I", [5] * 40),
                                                                         BS)


def test_the_precise_example_config_builds_and_the_app_subscribes_for_it() -> None:
    from pathlib import Path

    import kvyard.epp
    from kvyard.epp.app import EppApp, EppConfig
    from kvyard.epp.scheduling.config import load_config

    path = Path(kvyard.epp.__file__).parent / "scheduler.precise.example.yaml"
    s = build_scheduler(load_config(path))
    assert [(sc.name, w) for sc, w in s.scorers] == [
        ("precise-prefix-cache", 3.0), ("queue", 2.0), ("kv-cache-utilization", 2.0)]
    app = EppApp(EppConfig(config=str(path), model="none", kv_events_port=5557))
    assert app.kv_events is not None and app.kv_events.port == 5557
    assert app.metrics.registry.get_sample_value("kvyard_epp_kv_index_bytes") == 0
    assert EppApp(EppConfig(model="none")).kv_events is None   # the default: none


def test_a_shared_prefix_stays_on_its_pod_until_its_queue_is_really_longer() -> None:
    """Queue differences of a few requests no longer outweigh a cached prefix (here
    half of each prompt: 3 x 0.5 against the queue scorer's 2)."""
    from kvyard.common.hashing import block_hashes as bh
    from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec

    pool = EndpointPool()
    pool.set_source("s", [EndpointSpec(f"10.0.0.{i}:8000") for i in range(4)])
    sched = build_scheduler(seed=2)
    shared = list(range(64 * 10))

    def req(q: int) -> SchedRequest:
        return SchedRequest("m", LazyPrompt.of_hashes(bh(shared + [q] * 640, 64)))
    first = sched.schedule(req(0), pool.all()).endpoint
    for q in range(1, 6):      # its queue grows by one a request; the others stay idle
        first.pending = q
        d = sched.schedule(req(q), pool.all())
        assert d.endpoint is first and d.matched_blocks == 10, q
    first.pending = 12         # really longer: now it spreads
    assert sched.schedule(req(99), pool.all()).endpoint is not first


def test_precise_matches_feed_the_pd_decider() -> None:
    """Decode first: a prompt the decode pod truly holds is not sent to a prefill pod;
    one it does not hold is."""
    sched = build_scheduler({
        "profileHandler": {"type": "disagg-profile-handler", "nonCachedTokens": 256},
        "profiles": {
            "decode": {"filters": ["role"], "scorers": [
                {"type": "precise-prefix-cache", "weight": 1, "speculativeTTL": 0.0}]},
            "prefill": {"filters": ["prefill-role"], "scorers": [{"type": "queue"}]}}})
    decode, prefill = Endpoint(A, "decode"), Endpoint(B, "prefill")
    scorer = sched.profiles["decode"].scorers[0][0]
    scorer.index.subscribed = {A, B}
    held, cold = _tokens(20, 40 * BS), _tokens(21, 40 * BS)
    scorer.index.apply(A, [_stored_map(held, 3)])
    d = sched.schedule(_req(held), [decode, prefill])
    assert d.endpoint is decode and d.prefill is None and d.matched_blocks == 10
    d = sched.schedule(_req(cold), [decode, prefill])
    assert d.endpoint is decode and d.prefill is prefill and d.matched_blocks == 0


def test_bytes_engine_hashes_adapters_and_extra_keys() -> None:
    """vLLM's default engine keys are bytes (sha256); an adapter's blocks and blocks with
    extra keys (images) are never matched by a plain prompt's tokens."""
    toks = _tokens(30, 4 * BS)
    scorer = PrecisePrefixScorer(speculative=Speculative(0.0))
    scorer.index.subscribed = {A, B}
    keys = [bytes([i]) * 32 for i in range(4)]
    ev = {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": None,
          "token_ids": toks, "block_size": BS, "medium": None}
    scorer.index.apply(A, [ev])
    scorer.index.apply(B, [dict(ev, lora_name="sql-adapter")])
    scorer.index.apply(B, [dict(ev, extra_keys=[("img", 1), None, None, None])])
    assert _matched(scorer, toks, A, B) == [1.0, 0.0]
    scorer.index.apply(A, [{"type": "BlockRemoved", "block_hashes": keys[2:]}])
    assert _matched(scorer, toks, A) == [0.5]


def test_many_endpoints_each_get_their_own_longest_prefix() -> None:
    toks = _tokens(40, 8 * BS)
    eps = [f"10.1.0.{i}:8000" for i in range(50)]
    scorer = PrecisePrefixScorer(speculative=Speculative(0.0))
    scorer.index.subscribed = set(eps)
    for i, a in enumerate(eps):
        scorer.index.apply(a, [_stored_map(toks, 1, end=i % 9)] if i % 9 else [])
    got = _matched(scorer, toks, *eps)
    assert got == [(i % 9) / 8 for i in range(50)]


def test_an_adapters_blocks_match_only_requests_for_that_adapter() -> None:
    toks = _tokens(3, 6 * BS)
    scorer = PrecisePrefixScorer(speculative=Speculative(0.0))
    scorer.index.subscribed = {A, B}
    scorer.index.apply(A, [{**_stored_map(toks, salt=5), "lora_name": "tone"}])
    scorer.index.apply(B, [_stored_map(toks, salt=5)])  # the base model's blocks of the same tokens
    for adapter, holder in (("tone", A), ("", B), ("other", None)):
        req = _req(toks)
        req.adapter = adapter
        scores = dict(zip((A, B), scorer.score(req, [Endpoint(A), Endpoint(B)])))
        if holder is None:
            assert scores[A] == scores[B] == 0.0, adapter
        else:
            assert scores[holder] > 0.0 and scores[A if holder == B else B] == 0.0, adapter
