"""Greedy output is token-identical to Hugging Face transformers on the demo model (float32).

Three ways through the engine, each against the same HF reference: every
prompt alone, all prompts as one concurrent batch of mixed lengths (prefill
chunks interleaved with decodes), and the batch again once their prefixes
sit in the prefix cache.
"""
from __future__ import annotations

import pytest
import torch

from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.llm import LLM
from kvyard.workers.engine.llm_engine import LLMEngine

# HF's reference plus three engine passes is minutes of CPU on a busy machine
pytestmark = pytest.mark.timeout(1800)

NEW_TOKENS = 48
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in detail how a bicycle works, covering the frame, the wheels, the chain, "
    "the gears and the brakes, and why riding one keeps you balanced.",
    "Tell me a story about a dragon who learns to bake bread in a small mountain village.",
    "Why is the sky blue? Answer like a physics teacher talking to curious twelve year olds "
    "who have never heard of scattering, wavelengths or the atmosphere's composition.",
    "Translate 'good morning' into Spanish, French and German.",
    "What are three tips for writing clean Python code?",
]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = load_tokenizer("demo")
    ids = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in ids}) >= 6, "prompt lengths should vary"
    return ids


LOGPROB_PROMPTS = 3  # prompts whose greedy tokens' logprobs are checked against HF's


@pytest.fixture(scope="module")
def hf_run(demo_gguf, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF transformers' greedy continuations, computed once per module, and for the
    first LOGPROB_PROMPTS of them the log_softmax at every generated position."""
    from transformers import AutoModelForCausalLM

    p = demo_gguf
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, torch_dtype=torch.float32)
    model.eval()
    out, lps = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=NEW_TOKENS, pad_token_id=model.config.eos_token_id)
            out.append(y[0, len(ids):].tolist())
            if len(lps) < LOGPROB_PROMPTS:  # every position: prompt and generated tokens
                lps.append(torch.log_softmax(model(y[:, :-1]).logits[0].float(), dim=-1))
    del model
    return out, lps


@pytest.fixture(scope="module")
def hf_reference(hf_run) -> list[list[int]]:
    return hf_run[0]


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32)
    return model, cfg, load_tokenizer("demo")


def engine(loaded, **kw) -> LLM:
    model, cfg, tok = loaded
    conf = EngineConfig(dtype="float32", kv_cache_memory_bytes=128 << 20, **kw)
    return LLM(engine=LLMEngine(conf, model, cfg, tok))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def _check(outs, ref):
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r, f"prompt {i} ({QUESTIONS[i][:30]!r}) diverges from transformers"


def test_each_prompt_alone_matches_transformers(loaded, prompts, hf_reference):
    llm = engine(loaded, enable_prefix_caching=False)
    _check([llm.generate([p], GREEDY)[0] for p in prompts], hf_reference)
    assert any(len(r) == NEW_TOKENS for r in hf_reference)


def test_concurrent_mixed_batch_matches_transformers(loaded, prompts, hf_reference):
    # a small token budget splits the long prompts into chunks that share steps with decodes
    llm = engine(loaded, enable_prefix_caching=False, max_num_batched_tokens=64)
    _check(llm.generate(prompts, GREEDY), hf_reference)


def test_cached_prefixes_match_transformers(loaded, prompts, hf_reference):
    llm = engine(loaded, max_num_batched_tokens=128)
    _check(llm.generate(prompts, GREEDY), hf_reference)
    before = llm.engine.stats().prefix_hits_tokens
    outs = llm.generate(prompts, GREEDY)
    _check(outs, hf_reference)
    assert llm.engine.stats().prefix_hits_tokens > before
    assert all(o.num_cached_tokens > 0 for o in outs)


def test_logprobs_match_transformers(loaded, prompts, hf_run):
    """The raw logprobs reported for greedy tokens (top-5) and for the prompt's tokens
    (top-2) are HF's log_softmax at the same positions (float32; a few ulps of
    summation order apart)."""
    ref_tokens, ref_lps = hf_run
    llm = engine(loaded)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, prompt_logprobs=2)
    outs = llm.generate(prompts[:LOGPROB_PROMPTS], params)
    for o, p, toks, lp in zip(outs, prompts, ref_tokens, ref_lps, strict=False):
        assert o.token_ids == toks and len(o.logprobs) == len(toks)
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        entries = [(pos - 1, e) for pos, e in enumerate(o.prompt_logprobs) if e is not None]
        entries += [(len(p) - 1 + i, e) for i, e in enumerate(o.logprobs)]
        for pos, e in entries:
            assert e.token_id == (p + toks)[pos + 1]
            assert e.logprob == pytest.approx(float(lp[pos, e.token_id]), abs=2e-3)
            for tid, v in e.top:
                assert v == pytest.approx(float(lp[pos, tid]), abs=2e-3)
            assert [t for t, _ in e.top][0] == int(lp[pos].argmax())
