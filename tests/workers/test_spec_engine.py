"""Speculative decoding through the engine on the demo model (float32): greedy tokens are
Hugging Face transformers' with n-gram lookup and with a draft model, in a continuous batch
that mixes speculative rows with plain ones; stop strings, max_tokens and logprobs come out
as without speculation; rejected positions never reach the prefix cache or KV events, and
every block comes back."""
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

pytestmark = pytest.mark.timeout(900)

NEW = 40
DOC = ("def area(width, height):\n    return width * height\n\n"
       "def perimeter(width, height):\n    return 2 * (width + height)\n")
QUESTIONS = [
    "Repeat this code exactly, then stop:\n" + DOC,
    "Quote this sentence twice: the river runs past the old mill and under the stone bridge.",
    "What is the capital of France?",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "policy": "always"}
DRAFT = {"method": "draft_model", "model": "demo", "draft_layers": 24, "num_speculative_tokens": 3,
         "policy": "always"}


@pytest.fixture(scope="module")
def loaded():
    """The demo model (float32), its config and tokenizer, loaded once for every engine here."""
    from kvyard.workers.model import load_model

    return (*load_model(resolve_model("demo"), torch.float32), load_tokenizer("demo"))


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    return [loaded[2].encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_reference(demo_gguf, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    p = demo_gguf
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, torch_dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                               pad_token_id=model.config.eos_token_id)
            out.append(y[0, len(ids):].tolist())
    return out


def make(loaded, spec=None, **kw) -> LLM:
    model, cfg, tok = loaded
    conf = EngineConfig(dtype="float32", model="demo", kv_cache_memory_bytes=32 << 20, max_model_len=1024,
                        speculative_config=spec, **kw)
    return LLM(engine=LLMEngine(conf, model, cfg, tok))


def _record_batches(llm: LLM) -> list[tuple[int, int]]:
    """(plain decode rows, speculative rows) of every step that drafted."""
    seen: list[tuple[int, int]] = []
    spec = llm.engine.speculator
    plan = spec.plan

    def recording(sched):
        plan(sched)
        n_spec = sum(1 for s in sched.seqs if s.spec_token_ids)
        if n_spec:
            seen.append((sched.num_decodes, n_spec))

    spec.plan = recording
    return seen


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)


def test_ngram_greedy_matches_transformers_in_a_mixed_batch(loaded, prompts, hf_reference):
    llm = make(loaded, NGRAM)
    batches = _record_batches(llm)
    # beside the greedy prompts: a row that may not speculate (penalties) and a sampled one
    extra = [SamplingParams(temperature=0.8, max_tokens=NEW, presence_penalty=0.5, seed=1),
             SamplingParams(temperature=0.8, max_tokens=NEW, seed=2)]
    outs = llm.generate(prompts + prompts[:2], [GREEDY] * len(prompts) + extra)
    assert [o.token_ids for o in outs[:3]] == hf_reference
    assert all(len(o.token_ids) == NEW or o.finish_reason == "stop" for o in outs[3:])
    st = llm.engine.stats().spec_decode
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    assert len(st.accepted_per_pos) == 4 and st.accepted_per_pos[0] >= st.accepted_per_pos[3]
    assert any(plain > 0 for plain, _ in batches), "no step mixed plain decodes with drafts"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks    # rejected positions' blocks all came back


def test_draft_model_greedy_matches_transformers(loaded, prompts, hf_reference):
    llm = make(loaded, DRAFT)
    outs = llm.generate(prompts[:1], GREEDY)
    assert [o.token_ids for o in outs] == hf_reference[:1]
    st = llm.engine.stats().spec_decode
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_stops_lengths_and_logprobs_are_as_without_speculation(loaded, prompts):
    plain, spec = make(loaded), make(loaded, NGRAM)
    first = plain.generate([prompts[0]], GREEDY)[0]
    stop_at = first.text[len(first.text) // 2:][:8]        # a stop string from the middle
    assert stop_at.strip()
    cases = [SamplingParams(temperature=0.0, max_tokens=NEW, stop=[stop_at]),
             SamplingParams(temperature=0.0, max_tokens=7),
             SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=3)]
    for params in cases:
        a, b = plain.generate(prompts[:2], params), spec.generate(prompts[:2], params)
        for x, y in zip(a, b, strict=True):
            assert (y.token_ids, y.text, y.finish_reason) == (x.token_ids, x.text, x.finish_reason)
            assert len(y.logprobs) == len(x.logprobs)
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert ly.token_id == lx.token_id
                assert ly.logprob == pytest.approx(lx.logprob, abs=1e-3)
                assert [t for t, _ in ly.top] == [t for t, _ in lx.top]
    assert a[0].finish_reason == "stop" and not a[0].text.endswith(stop_at)
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0


def test_only_verified_blocks_reach_the_prefix_cache_and_kv_events(loaded, prompts):
    llm = make(loaded, NGRAM, block_size=4)
    stored = []
    llm.engine.add_kv_event_listener(lambda ev: stored.append(ev) if ev.kind == "stored" else None)
    out = llm.generate([prompts[0]], GREEDY)[0]
    assert llm.engine.stats().spec_decode.num_draft_tokens > llm.engine.stats().spec_decode.num_accepted_tokens
    full = prompts[0] + out.token_ids
    truth = block_hashes(full, 4)
    published = [h for ev in stored for h in ev.block_hashes]
    assert published and set(published) <= set(truth)  # no block of a rejected draft's tokens
    for ev in stored:
        i = truth.index(ev.block_hashes[0])
        assert ev.token_ids == full[i * 4:(i + len(ev.block_hashes)) * 4]
    # the cache serves the next request, and its output does not change
    again = llm.generate([prompts[0]], GREEDY)[0]
    assert again.token_ids == out.token_ids and again.num_cached_tokens > 0


def test_the_kvstore_gets_only_verified_blocks(loaded, prompts):
    """Blocks saved while speculating, loaded by an engine without speculation whose prompt
    is that output, give the tokens that computing them gives: no rejected draft's KV."""
    from kvyard.kvstore import StoreConfig
    from kvyard.workers.kvconnector import StoreConnector, model_identity_of

    ident = model_identity_of("demo")
    saver = StoreConnector(StoreConfig(dram_bytes=1 << 26), ident, pin_memory=False)
    spec = make(loaded, NGRAM, kv_connector=saver)
    out = spec.generate([prompts[0]], GREEDY)[0]
    st = spec.engine.stats().spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens       # drafts accepted and rejected
    follow = prompts[0] + out.token_ids
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = make(loaded).generate([follow], params)[0].token_ids
    loader = StoreConnector(StoreConfig(dram_bytes=1 << 26), ident, store=saver.store, pin_memory=False)
    got = make(loaded, kv_connector=loader).generate([follow], params)[0]
    assert got.token_ids == want
    assert got.num_cached_tokens > len(prompts[0])                # output blocks came from the store
