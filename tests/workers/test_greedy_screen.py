"""The float32 greedy screen (workers/model/greedy_screen.py + cpu_ops/greedy.c): its
token is the full float32 LM head's argmax, bit for bit, ties and near-ties included,
and the engine's greedy rows give the same outputs through it as without it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers import cpu_ops
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.llm import LLM
from kvyard.workers.engine.llm_engine import LLMEngine
from kvyard.workers.model.greedy_screen import GreedyScreen

OPS = cpu_ops.load()
pytestmark = pytest.mark.skipif(OPS is None or not OPS.has_gemm(torch.bfloat16),
                                reason="needs gemm.c's bf16 path (AVX512-BF16)")


def _head(v: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * torch.rand(v, 1, generator=g) * 3
    w[[3, 5]] = torch.randn(2, k, generator=g) * 10  # the longest rows: x along them makes them the top
    # near-twins below bf16's resolution: the screen cannot tell them apart, only exact logits can
    w[7] = w[5] * (1 + 2.0 ** -20)
    w[9] = w[5]                                    # an exact tie with row 5: the first one wins
    w[v - 1] = w[3] + 2.0 ** -18
    return w.contiguous()


@pytest.mark.parametrize("v,k", [(1000, 64), (4160, 96)])
@pytest.mark.parametrize("layout", ["row-major", "tiles"])
def test_screened_argmax_is_the_full_float32_argmax(v, k, layout) -> None:
    w = _head(v, k, v + k)
    packed = cpu_ops.GemmWeight.pack(w)
    screen = GreedyScreen.build(OPS, w, None if layout == "row-major" else packed)
    assert screen is not None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, k, generator=g)
    x[:8] = w[[5, 7, 9, 3, v - 1, 5, 3, 100]] * 4   # rows aimed at the twins and the tie
    x[8:12] *= 1e-3                                  # small logits: the bound is relative
    x[12] = 0.0                       # every logit zero: too many candidates, the full GEMM's job
    full = OPS.gemm(x, packed)
    want = full.argmax(dim=-1)
    assert all(t in (5, 7, 9, 3, v - 1) for t in want[:7].tolist())  # the twins decide, by a hair
    got = screen.tokens(x)
    assert got[12].item() == -1
    got[12] = want[12]
    assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()


def test_nonfinite_rows_ask_for_the_full_gemm() -> None:
    w = _head(512, 64, 3)
    screen = GreedyScreen.build(OPS, w, None)
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    got = screen.tokens(x)
    assert got[1].item() == -1 and got[2].item() == -1
    want = OPS.gemm(x, cpu_ops.GemmWeight.pack(w)).argmax(dim=-1)
    assert got[0] == want[0] and got[3] == want[3]


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32)
    return model, cfg, load_tokenizer("demo")


def test_demo_model_screens_its_tied_quantized_head(loaded) -> None:
    """The demo's head is its Q8_0 embedding: exact rows come from the dense embedding,
    which must hold the very values the quantized tiles expand to."""
    model, cfg, _ = loaded
    assert model.greedy is not None
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(48, cfg.hidden_size, generator=g) * 3
    want = model.compute_logits(hidden).argmax(dim=-1)
    assert torch.equal(model.greedy_tokens(hidden), want)
    eye = torch.eye(cfg.hidden_size)[:40]
    assert torch.equal(OPS.gemm(eye, model.lm_head).t(), model.embed[:, :40].contiguous().detach())


def test_engine_tokens_are_the_same_with_and_without_the_screen(loaded) -> None:
    model, cfg, tok = loaded
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("Name a color.", "Why is the sky blue?", "Count to five.", "Write a haiku about rain.",
                "What is 7 times 8?", "Say something kind.")]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, seed=7, ignore_eos=True)
    with_lp = dataclasses.replace(greedy, logprobs=2)
    params = [greedy, greedy, sampled, greedy, with_lp, greedy]

    def run():
        conf = EngineConfig(dtype="float32", kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
        outs = LLM(engine=LLMEngine(conf, model, cfg, tok)).generate(prompts, params)
        return [o.token_ids for o in outs], [[e.token_id for e in o.logprobs] for o in outs]

    screened = run()
    saved, model.greedy = model.greedy, None
    try:
        plain = run()
    finally:
        model.greedy = saved
    assert screened == plain
    assert screened[1][4] == screened[0][4]  # the logprobs row reports the tokens it got
