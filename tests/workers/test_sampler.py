"""Sampler and stop handling: greedy, seeds independent of the batch, top-k/top-p support, stop strings."""
from __future__ import annotations

import pytest
import torch

from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.sampler import Sampler, make_generator
from kvyard.workers.engine.sequence import Sequence
from kvyard.workers.engine.stopping import append_token, find_stop, held_back

V = 1000


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_even_with_other_rows_sampling():
    x = logits(4)
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9)]
    got = Sampler(0)(x, ps, [None] * 4)
    assert got[0] == int(x[0].argmax()) and got[2] == int(x[2].argmax())


def test_seeded_requests_repeat_regardless_of_batch_composition():
    row = logits(1, seed=5)[0]
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_size: int, where: int, steps: int = 6) -> list[int]:
        gen = make_generator(p.seed)
        sampler = Sampler(seed=batch_size)       # unseeded neighbours draw from elsewhere
        out = []
        for step in range(steps):
            x = logits(batch_size, seed=100 + step)
            x[where] = row
            params = [SamplingParams(temperature=1.0)] * batch_size
            params[where] = p
            gens: list = [None] * batch_size
            gens[where] = gen
            if batch_size > 2:                   # another seeded request alongside
                other = (where + 1) % batch_size
                params[other] = SamplingParams(temperature=0.5, seed=9)
                gens[other] = make_generator(9 + step)
            out.append(Sampler.__call__(sampler, x, params, gens)[where])
        return out

    alone = run(1, 0)
    assert run(5, 3) == alone and run(9, 0) == alone
    assert len(set(alone)) > 1                   # it really samples (not secretly greedy)


def _draws(params: SamplingParams, x: torch.Tensor, n: int = 300) -> set[int]:
    s = Sampler(0)
    batch = x.expand(n, -1).contiguous()
    return set(s(batch, [params] * n, [None] * n))


def test_top_k_restricts_support():
    x = logits(1, seed=3)
    top3 = set(x[0].topk(3).indices.tolist())
    got = _draws(SamplingParams(temperature=5.0, top_k=3), x)
    assert got <= top3 and len(got) > 1
    assert _draws(SamplingParams(temperature=5.0, top_k=1), x) == {int(x[0].argmax())}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
    x = torch.log(probs.clamp_min(1e-30)).unsqueeze(0)
    assert _draws(SamplingParams(temperature=1.0, top_p=0.7), x) == {0, 1}
    assert _draws(SamplingParams(temperature=1.0, top_p=0.85), x) == {0, 1, 2}
    assert _draws(SamplingParams(temperature=1.0, top_p=0.5), x) == {0}


def test_mixed_top_k_and_top_p_rows_do_not_leak_into_each_other():
    x = logits(1, seed=8).expand(2, -1).contiguous()
    s = Sampler(0)
    params = [SamplingParams(temperature=2.0, top_k=2), SamplingParams(temperature=2.0)]
    seen = [set(), set()]
    for _ in range(200):
        a, b = s(x, params, [None, None])
        seen[0].add(a)
        seen[1].add(b)
    assert seen[0] <= set(x[0].topk(2).indices.tolist())
    assert len(seen[1]) > 2


def test_find_stop_and_held_back():
    assert find_stop("hello world", ["wor"], 6) == 6
    assert find_stop("hello world", ["lo w", "xyz"], 6) == 3      # spans the new text's start
    assert find_stop("hello", ["he"], 5) is None                  # ended before the new text
    assert held_back("the end is ne", ["near", "x"]) == 2
    assert held_back("abc", ["zz"]) == 0


@pytest.fixture(scope="module")
def tok():
    from kvyard.common.tokenizer import load_tokenizer

    return load_tokenizer("demo")


def fed(tok, text: str, params: SamplingParams) -> tuple[Sequence, list[int]]:
    prompt = tok.encode("Say something.")
    s = Sequence("r", prompt, len(prompt), params)
    s.detokenizer = tok.incremental_detokenizer(prompt[-4:])
    return s, tok.encode(text)


@pytest.mark.parametrize("stop", [["STOP"], ["ST", "STOP"], ["xx", "OP!"], ["lo S"]])
def test_stop_string_across_tokens_is_trimmed_and_never_streamed(tok, stop):
    full = "Hello STOP! more words"
    seq, ids = fed(tok, full, SamplingParams(max_tokens=50, stop=stop))
    assert len(ids) > 3
    streamed, reason = "", None
    for t in ids:
        delta, reason = append_token(seq, t, tok.eos_token_ids, 10_000)
        streamed += delta
        if reason:
            break
    cut = min(full.find(s) for s in stop if s in full)
    assert reason == "stop" and streamed == full[:cut] and seq.output_text == full[:cut]


def test_eos_max_tokens_and_ignore_eos(tok):
    eos = tok.eos_token_id
    s, ids = fed(tok, "a b c", SamplingParams(max_tokens=3))
    delta, reason = append_token(s, ids[0], tok.eos_token_ids, 100)
    assert delta == "a" and reason is None
    assert append_token(s, eos, tok.eos_token_ids, 100) == ("", "stop")
    assert s.output_text == "a" and s.output_token_ids == [ids[0], eos]
    s, ids = fed(tok, "a b c", SamplingParams(max_tokens=2, ignore_eos=True))
    assert append_token(s, eos, tok.eos_token_ids, 100)[1] is None
    assert append_token(s, ids[1], tok.eos_token_ids, 100)[1] == "length"
    s, ids = fed(tok, "a b c", SamplingParams(max_tokens=5, stop_token_ids=[ids[1]]))
    assert append_token(s, ids[1], tok.eos_token_ids, 100) == ("", "stop")
    s, ids = fed(tok, "a b c", SamplingParams(max_tokens=50))
    assert append_token(s, ids[0], tok.eos_token_ids, s.num_tokens + 1)[1] == "length"  # max_model_len
