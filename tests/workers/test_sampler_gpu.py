"""Sampling on the GPU (sampler.py): the dense top-k/top-p cut the GPU uses draws the same
token as the host's candidate loop for the same uniforms (checked on the CPU, where both
run); on CUDA (skipped without a GPU) the whole sampler gives the host's tokens for the
same logits and seeds, adjustments, logprobs and greedy rows included."""
from __future__ import annotations

import pytest
import torch

from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.sampler import (Sampler, _sample_truncated, _sample_truncated_dense,
                                           make_generator)

V = 5000


def _probs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, generator=g) * 6          # sharp and flat rows (flat: nucleus past 1024)
    return torch.softmax(torch.randn(n, V, generator=g) * scale, dim=-1)


@pytest.mark.parametrize("case", ["top_k", "top_p", "both", "mixed"])
def test_dense_cut_draws_the_same_tokens_as_the_candidate_loop(case) -> None:
    n = 64
    probs = _probs(n, {"top_k": 1, "top_p": 2, "both": 3, "mixed": 4}[case])
    g = torch.Generator().manual_seed(9)
    u = torch.rand(n, generator=g)
    ks = {"top_k": [int(k) for k in torch.randint(1, 2000, (n,), generator=g)], "top_p": [V] * n,
          "both": [int(k) for k in torch.randint(1, 3000, (n,), generator=g)],
          "mixed": [V if i % 3 else 40 for i in range(n)]}[case]
    ps = {"top_k": [1.0] * n, "top_p": [float(p) for p in 0.05 + 0.9 * torch.rand(n, generator=g)],
          "both": [float(p) for p in 0.05 + 0.9 * torch.rand(n, generator=g)],
          "mixed": [0.9 if i % 2 else 1.0 for i in range(n)]}[case]
    ps = [p if k < V or p < 1.0 else 0.5 for k, p in zip(ks, ps)]     # every row truncated somehow
    want = _sample_truncated(probs, u, ks, ps)
    got = _sample_truncated_dense(probs, u, ks, ps)
    assert torch.equal(got, want)
    order = probs.argsort(dim=-1, descending=True)
    rank = (order == got.unsqueeze(1)).int().argmax(dim=-1)
    assert all(int(r) < k for r, k in zip(rank, ks))      # never past top-k


def test_dense_cut_at_the_top_of_the_unit_interval_stays_in_the_kept_set() -> None:
    probs = _probs(8, 7)
    u = torch.full((8,), 1.0 - 1e-7)
    ks, ps = [5, V, 100, V, 1, 3000, V, 2], [1.0, 0.3, 0.8, 0.99, 1.0, 0.5, 0.01, 1.0]
    got = _sample_truncated_dense(probs, u, ks, ps)
    assert torch.equal(got, _sample_truncated(probs, u, ks, ps))
    assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_gpu_sampler_gives_the_hosts_tokens() -> None:
    n = 48
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 32000, generator=g) * 4
    params = []
    for i in range(n):
        kind = i % 6
        params.append(SamplingParams(
            temperature=[0.0, 0.8, 1.0, 0.7, 1.2, 0.9][kind], top_k=[-1, -1, 50, -1, 200, -1][kind],
            top_p=[1.0, 1.0, 1.0, 0.9, 0.8, 1.0][kind], seed=1000 + i if i % 4 == 0 else None,
            logprobs=2 if i % 5 == 0 else None,
            repetition_penalty=1.3 if kind == 5 else 1.0, logit_bias={7: 5.0} if kind == 5 else None))
    hist = [(list(range(i, i + 20)), 10) for i in range(n)]

    def run(logits: torch.Tensor):
        gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
        return Sampler(42).sample(logits, params, gens, hist)

    want_tok, want_lp = run(x)
    got_tok, got_lp = run(x.cuda())
    same = sum(a == b for a, b in zip(got_tok, want_tok))
    assert same >= n - 1, (got_tok, want_tok)       # float rounding may move a boundary, rarely
    for a, b in zip(got_lp, want_lp):
        assert (a is None) == (b is None)
        if a is not None and a.token_id == b.token_id:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@cuda
def test_engine_samples_on_the_gpu_the_same_with_graphs_and_eager(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvyard.common.models import resolve_model
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.model import load_model

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).float().save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[3, 4, 5, 6], list(range(10, 40)), [7] * 9]
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=12, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    runs = []
    for eager in (False, True):
        model, mc = load_model(resolve_model(str(tmp_path)), torch.float32, 1024, device="cuda")
        conf = EngineConfig(model=str(tmp_path), dtype="float32", device="cuda", enforce_eager=eager,
                            max_model_len=1024, max_num_seqs=8, kv_cache_memory_bytes=32 << 20)
        llm = LLM(engine=LLMEngine(conf, model, mc, None))
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
    assert all(len(t) == 24 for t in runs[0])
    assert runs[0][0] != runs[0][2][:24] or runs[0][1] != runs[0][2]   # sampling is not greedy here
