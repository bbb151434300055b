"""The engine on the real demo model: chunking, preemption, stops, seeds, the KV connector hook."""
from __future__ import annotations

import pytest
import torch

from kvyard.common.hashing import block_hashes
from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.llm import LLM
from kvyard.workers.engine.llm_engine import LLMEngine
from kvyard.workers.engine.model_runner import kv_block_bytes

QUESTIONS = ["Name a color.", "What is two plus two? Explain your reasoning step by step.",
             "Say hello to the world in a friendly, enthusiastic and slightly long-winded way.",
             "Why do cats purr?"]


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32)
    return model, cfg, load_tokenizer("demo")


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    tok = loaded[2]
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def make(loaded, connector=None, **kw) -> LLM:
    model, cfg, tok = loaded
    kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    conf = EngineConfig(dtype="float32", kv_connector=connector, **kw)
    return LLM(engine=LLMEngine(conf, model, cfg, tok))


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(loaded, prompts) -> list[list[int]]:
    """Greedy continuations with a roomy cache and a budget that never chunks."""
    return [o.token_ids for o in make(loaded, max_num_batched_tokens=4096).generate(prompts, GREEDY)]


def test_chunked_prefill_equals_unchunked(loaded, prompts, reference):
    llm = make(loaded, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference


def test_preemption_recomputes_to_the_same_tokens(loaded, prompts, reference):
    model, cfg, _ = loaded
    need = max(len(p) for p in prompts) + GREEDY.max_tokens
    blocks = -(-need // 16) + 2                       # one sequence fits, four do not
    llm = make(loaded, kv_cache_memory_bytes=blocks * kv_block_bytes(cfg, 16, torch.float32))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    st = llm.engine.stats()
    assert st.num_preemptions > 0 and st.kv_cache_usage == 0.0 and st.num_running == 0


def test_stop_string_is_trimmed_on_real_text(loaded, prompts):
    llm = make(loaded)
    base = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=16))[0]
    text = base.text
    assert len(text) > 12
    stop = text[8:12]                                 # may start or end mid-token
    got = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0]
    assert got.finish_reason == "stop" and got.text == text[:text.find(stop)]
    assert stop not in got.text


def test_eos_ends_generation_and_is_not_in_text(loaded, prompts):
    llm = make(loaded)
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert out.text and out.text == llm.engine.tokenizer.decode(out.token_ids[:-1])


def test_seeded_sampling_repeats_alone_and_in_a_batch(loaded, prompts):
    llm = make(loaded)
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=42, ignore_eos=True)
    alone = llm.generate([prompts[1]], p)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate([prompts[0], prompts[1], prompts[3]], [others, p, others])
    assert batch[1].token_ids == alone
    assert llm.generate([prompts[1]], p)[0].token_ids == alone


def test_logprobs_and_logit_adjustments_through_the_engine(loaded, prompts, reference):
    """Plumbing from SamplingParams to the batch: logprobs ride along without changing
    the tokens; min_tokens, logit_bias and penalties change only their own request."""
    import dataclasses

    llm = make(loaded)
    with_lp = dataclasses.replace(GREEDY, logprobs=3)
    outs = llm.generate(prompts[:2], [with_lp, GREEDY])
    assert [o.token_ids for o in outs] == reference[:2]
    assert [e.token_id for e in outs[0].logprobs] == reference[0] and outs[1].logprobs == []
    assert all(e.top[0][0] == e.token_id and len(e.top) == 3 for e in outs[0].logprobs)

    first = reference[0][0]
    stop_now = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first])
    assert llm.generate([prompts[0]], stop_now)[0].token_ids == [first]
    held = dataclasses.replace(stop_now, min_tokens=3)
    got = llm.generate([prompts[0]], held)[0].token_ids
    assert len(got) >= 3 and first not in got[:3]

    biased = dataclasses.replace(GREEDY, logit_bias={1000: 100.0})
    outs = llm.generate(prompts[:2], [biased, GREEDY])
    assert outs[0].token_ids == [1000] * GREEDY.max_tokens and outs[1].token_ids == reference[1]

    rep = max(reference, key=lambda r: len(r) - len(set(r)))
    assert len(rep) > len(set(rep)), "some reference repeats a token"
    i = reference.index(rep)
    pen = dataclasses.replace(GREEDY, frequency_penalty=2.0)
    assert llm.generate([prompts[i]], pen)[0].token_ids != rep


def test_prompt_logprobs_survive_chunking_caching_and_preemption(loaded, prompts, reference):
    """Every prompt position is computed even when its blocks are cached (the cache may
    not stand in for them), and chunked or preempted prefills report the same values."""
    import dataclasses

    model, cfg, _ = loaded
    want = dataclasses.replace(GREEDY, prompt_logprobs=1)
    base = make(loaded, max_num_batched_tokens=4096).generate(prompts, want)
    for o, p, ref in zip(base, prompts, reference):
        assert o.token_ids == ref and o.prompt_logprobs[0] is None
        assert [e.token_id for e in o.prompt_logprobs[1:]] == p[1:]
        assert all(len(e.top) == 1 and e.logprob <= e.top[0][1] + 1e-6 for e in o.prompt_logprobs[1:])

    def same(outs) -> None:
        for o, b in zip(outs, base):
            assert o.token_ids == b.token_ids
            got = [(e.token_id, round(e.logprob, 3)) for e in o.prompt_logprobs[1:]]
            assert got == [(e.token_id, round(e.logprob, 3)) for e in b.prompt_logprobs[1:]]
    llm = make(loaded, max_num_batched_tokens=16)
    llm.generate(prompts, GREEDY)                     # the prompts' blocks are now cached
    hits = llm.engine.stats().prefix_hits_tokens
    same(llm.generate(prompts, want))
    assert llm.engine.stats().prefix_hits_tokens == hits  # no hit was taken for them
    need = max(len(p) for p in prompts) + GREEDY.max_tokens
    blocks = -(-need // 16) + 2
    tight = make(loaded, kv_cache_memory_bytes=blocks * kv_block_bytes(cfg, 16, torch.float32),
                 max_num_batched_tokens=16)
    same(tight.generate(prompts, want))
    assert tight.engine.stats().num_preemptions > 0


def test_json_mode_outputs_one_json_object_greedy_and_sampled(loaded):
    """In JSON mode the demo model's answers are JSON objects (greedy, and sampled with
    seeds), each ending at its closing brace, and the greedy one says what was asked."""
    import json

    tok = loaded[2]
    prompt = tok.encode_chat([{"role": "user", "content": 'Return a JSON object with the keys '
                               '"name" and "age" for a cat called Tom who is 3.'}])
    llm = make(loaded)
    params = [SamplingParams(temperature=0.0, max_tokens=200, json_object=True)] + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=200, json_object=True) for s in (1, 2, 3)]
    outs = llm.generate([prompt] * 4, params)
    assert json.loads(outs[0].text) == {"name": "Tom", "age": 3}
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert isinstance(json.loads(o.text), dict), o.text
        assert o.text.endswith("}")
    again = llm.generate([prompt], params[1])[0]
    assert again.text == outs[1].text                 # seeded JSON sampling repeats


def test_json_schema_outputs_satisfy_the_schema_greedy_and_sampled(loaded):
    """With a schema the demo model's answers validate against it (greedy, and sampled
    hot, where an unconstrained model wanders most), each ending at its closing brace."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "colors": {"type": "array", "items": {"enum": ["black", "white", "orange", "grey"]},
                   "minItems": 1, "maxItems": 3},
        "indoor": {"type": "boolean"},
        "owner": {"type": ["string", "null"], "maxLength": 32}},
        "required": ["name", "age", "colors", "indoor"]}
    tok = loaded[2]
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a cat called Tom who is 3 "
                               "years old, in JSON."}])
    llm = make(loaded)
    params = [SamplingParams(temperature=0.0, max_tokens=200, json_schema=schema)] + [
        SamplingParams(temperature=1.2, seed=s, max_tokens=200, json_schema=schema)
        for s in (1, 2, 3, 4)]
    outs = llm.generate([prompt] * len(params), params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    greedy = json.loads(outs[0].text)
    assert greedy["name"] == "Tom" and greedy["age"] == 3, outs[0].text


def test_guided_choice_answers_with_one_of_the_choices(loaded):
    tok = loaded[2]
    ask = [tok.encode_chat([{"role": "user", "content": q}]) for q in (
        "Is the sky blue? Answer yes or no.", "What colour is grass?", "Say something.")]
    llm = make(loaded)
    choices = ["yes", "no", "green", "a dark shade of green"]
    params = [SamplingParams(temperature=0.0, max_tokens=20, guided_choice=choices)] * 3 + [
        SamplingParams(temperature=1.5, seed=s, max_tokens=20, guided_choice=choices)
        for s in range(4)]
    outs = llm.generate(ask + ask[:1] * 4, params)
    for o in outs:
        assert o.text in choices and o.finish_reason == "stop", o.text
    # unconstrained, the demo model answers "No." and "The colour of grass is ...": guided,
    # it keeps its own pick among the choices
    assert outs[0].text == "no" and outs[1].text == "a dark shade of green"


def test_guided_regex_outputs_match_the_pattern(loaded):
    import re

    tok = loaded[2]
    ask = tok.encode_chat([{"role": "user", "content": "Give me a phone number and a reason."}])
    pattern = r"(\d{3}-\d{4}|none), because [a-z ]{3,30}\."
    llm = make(loaded)
    params = [SamplingParams(temperature=0.0, max_tokens=60, guided_regex=pattern)] + [
        SamplingParams(temperature=1.2, seed=s, max_tokens=60, guided_regex=pattern)
        for s in range(4)]
    for o in llm.generate([ask] * len(params), params):
        assert re.fullmatch(pattern, o.text) and o.finish_reason == "stop", o.text


def test_prefix_cache_counts_hits_in_tokens(loaded, prompts):
    llm = make(loaded)
    events = []
    llm.engine.add_kv_event_listener(events.append)
    first = llm.generate(prompts[:1], GREEDY)[0]
    stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
    # the router recomputes these from token ids alone: they must be the common hashes
    assert stored == block_hashes(prompts[0] + first.token_ids[:-1], 16)
    st = llm.engine.stats()
    assert st.prefix_queries_tokens == len(prompts[0])
    again = llm.generate(prompts[:1], GREEDY)[0]
    st2 = llm.engine.stats()
    hit = (len(prompts[0]) - 1) // 16 * 16
    assert again.num_cached_tokens == hit and st2.prefix_hits_tokens - st.prefix_hits_tokens == hit
    assert st2.prompt_tokens_total == 2 * len(prompts[0])
    assert st2.generation_tokens_total == 2 * GREEDY.max_tokens


class MemoryConnector:
    """A minimal KV connector that copies blocks into host memory (what kvstore does, minus tiers)."""

    def __init__(self) -> None:
        self.store: dict[int, list[torch.Tensor]] = {}
        self.kv: list[torch.Tensor] = []
        self.loaded = 0

    def bind(self, kv_caches, block_size: int) -> None:
        self.kv = list(kv_caches)

    def lookup(self, block_hashes) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.store:
                break
            n += 1
        return n

    def load(self, block_hashes, block_ids) -> int:
        for h, b in zip(block_hashes, block_ids):
            for layer, blk in zip(self.kv, self.store[h]):
                layer[:, b].copy_(blk)
        self.loaded += len(block_ids)
        return len(block_ids)

    def save(self, block_hashes, block_ids) -> None:
        for h, b in zip(block_hashes, block_ids):
            self.store.setdefault(h, [layer[:, b].clone() for layer in self.kv])


def test_kv_connector_supplies_prefix_blocks_to_a_fresh_engine(loaded, prompts, reference):
    conn = MemoryConnector()
    first = make(loaded, connector=conn)
    assert [o.token_ids for o in first.generate(prompts, GREEDY)] == reference
    assert conn.store, "computed full blocks were not saved"
    second = make(loaded, connector=conn)             # empty local cache, same store
    outs = second.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert conn.loaded > 0 and all(o.num_cached_tokens > 0 for o in outs)
    # the first prompt's shared prefix came from the store; later ones found it locally
    local_hits = second.engine.stats().prefix_hits_tokens
    assert sum(o.num_cached_tokens for o in outs) == conn.loaded * 16 + local_hits
    assert local_hits < sum(o.num_cached_tokens for o in outs)


def test_stats_count_the_prompt_tokens_not_computed_yet(loaded, prompts):
    """kvyard:prompt_tokens_pending (the KEDA scaler's prefill backlog): queued prompts
    count whole, a chunked prefill counts what is left, a decoding request nothing."""
    eng = make(loaded, max_num_batched_tokens=16).engine
    long = prompts[0] * 3
    eng.add_request("a", long, GREEDY)
    eng.add_request("b", prompts[1], GREEDY)
    assert eng.stats().prompt_tokens_pending == len(long) + len(prompts[1])
    eng.step()                                   # one 16-token chunk of "a"
    assert eng.stats().prompt_tokens_pending == len(long) + len(prompts[1]) - 16
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                       for s in eng.scheduler.running):
        eng.step()
    assert eng.stats().prompt_tokens_pending == 0 and eng.scheduler.running  # now decoding


def test_a_stalled_step_is_logged_with_its_composition(loaded, prompts, reference, monkeypatch, caplog):
    """A step far slower than the recent ones is logged (what it ran, beside its time); the tokens
    are the same. The clock is a fake one that makes the fifth step take a second."""
    import logging

    from kvyard.workers.engine import llm_engine

    ticks = iter(range(10 ** 6))
    calls = {"n": 0}

    def clock() -> float:
        calls["n"] += 1   # two reads a step: a step lasts 10 ms, except the fifth (1 s)
        return next(ticks) * 0.01 + (0.99 if calls["n"] > 9 else 0.0)

    monkeypatch.setattr(llm_engine.time, "perf_counter", clock)
    llm = make(loaded, max_num_batched_tokens=4096)
    with caplog.at_level(logging.DEBUG, logger=llm_engine.__name__):
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert out == reference
    slow = [r.getMessage() for r in caplog.records if "slow step" in r.getMessage()]
    assert len(slow) == 1 and "decode rows" in slow[0] and "adapters ['-']" in slow[0]
