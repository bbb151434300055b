"""`kvyard bench route`'s workloads: deterministic, grouped as declared, token counts
that survive the tokenizer, traces parsed, and the ideal cache's hit rate."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvyard.bench.route_trace import (ENGINE_BLOCK, IdealCache, demand_tokens, ideal_hit_rate,
                                      read_azure, read_mooncake, read_trace, synthetic_mooncake)
from kvyard.bench.route_workload import (Ladder, RouteRequest, Segment, SharedPrefix, Vocab,
                                         arrivals, prompt_texts)

SHAPE = SharedPrefix(groups=6, prefix_tokens=96, users=3, question_tokens=40, output_tokens=8)


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab.demo()


def test_ladder_is_deterministic_and_sized_by_rate() -> None:
    a = Ladder([2.0, 5.0], 4.0, seed=3).build(SHAPE)
    b = Ladder([2.0, 5.0], 4.0, seed=3).build(SHAPE)
    c = Ladder([2.0, 5.0], 4.0, seed=4).build(SHAPE)
    assert [len(r) for r in a] == [8, 20]
    assert [[(x.at_s, x.segments) for x in r] for r in a] == \
        [[(x.at_s, x.segments) for x in r] for r in b]
    assert [[x.segments for x in r] for r in a] != [[x.segments for x in r] for r in c]
    for rung in a:
        assert all(x.at_s < y.at_s for x, y in zip(rung, rung[1:]))


def test_groups_share_their_prefix_and_nothing_else(vocab: Vocab) -> None:
    reqs = [r for rung in Ladder([100.0], 1.0).build(SHAPE) for r in rung]
    assert {r.group for r in reqs} <= set(range(SHAPE.groups))
    assert all(r.prompt_tokens == SHAPE.prefix_tokens + SHAPE.question_tokens for r in reqs)
    by_group: dict[int, set] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(r.segments[0])
        assert r.output_tokens == SHAPE.output_tokens
    assert all(len(s) == 1 for s in by_group.values())  # one prefix per group
    prefixes = [next(iter(s)) for s in by_group.values()]
    assert len(set(prefixes)) == len(prefixes)          # and a different one each
    questions = {r.segments[1] for r in reqs}
    assert len(questions) <= SHAPE.groups * SHAPE.users
    a, b = prefixes[:2]
    assert a.ids(vocab.ids)[:16] != b.ids(vocab.ids)[:16]


def test_multi_turn_prompts_grow_by_answer_and_question() -> None:
    shape = SharedPrefix(groups=1, prefix_tokens=32, users=1, question_tokens=10,
                         answer_tokens=5, turns=3, output_tokens=4)
    lens = [len(segs) for _, segs in shape.prompts(4, random.Random(0))]
    assert lens == [2, 4, 6, 2]  # the conversation restarts after `turns`
    _, (p, q0, a1, q1) = list(shape.prompts(2, random.Random(0)))[1]
    assert (p.length, q0.length, a1.length, q1.length) == (32, 10, 5, 10)
    assert shape.unique_tokens() == 32 + 10 * 3 + 5 * 2


def test_text_has_exactly_the_chosen_tokens(vocab: Vocab) -> None:
    from kvyard.common.tokenizer import load_tokenizer

    tok = load_tokenizer("demo")
    rungs = Ladder([50.0], 0.2).build(SHAPE)
    texts = prompt_texts(rungs, vocab)
    for r, text in zip(rungs[0], texts[0]):
        assert tok.encode(text) == r.token_ids(vocab.ids)
        assert len(tok.encode(text)) == r.prompt_tokens


def test_poisson_and_bursty_arrivals_keep_the_rate() -> None:
    for burst in (1.0, 0.25):
        at = arrivals(4000, 20.0, random.Random(1), burst)
        assert 4000 / at[-1] == pytest.approx(20.0, rel=0.1)
    assert arrivals(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]


def _req(at: float, *segs: tuple[int, int]) -> RouteRequest:
    return RouteRequest(at, tuple(Segment(s, n) for s, n in segs), 4)


def test_ideal_hit_rate_counts_leading_full_blocks(vocab: Vocab) -> None:
    b = ENGINE_BLOCK
    first = _req(0.0, (1, 4 * b), (2, b))
    again = _req(1.0, (1, 4 * b), (3, b))             # 4 shared blocks of 5
    assert ideal_hit_rate([first], vocab.ids) == 0.0
    assert ideal_hit_rate([first, again], vocab.ids) == pytest.approx(4 * b / (10 * b))
    # The whole prompt seen before: the last token is still computed, so one block less.
    assert ideal_hit_rate([first, first], vocab.ids) == pytest.approx(4 * b / (10 * b))
    # A rung continues with the cache the previous one left.
    cache = IdealCache(vocab.ids)
    assert cache.feed([first]) == 0.0
    assert cache.feed([again]) == pytest.approx(4 / 5)
    # Order is arrival order, not list order.
    assert ideal_hit_rate([again, first], vocab.ids) == ideal_hit_rate([first, again], vocab.ids)


def test_mooncake_trace_keeps_block_sharing(tmp_path: Path, vocab: Vocab) -> None:
    recs = [{"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 700, "output_length": 30, "hash_ids": [0, 3]},
            {"timestamp": 1500, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    reqs = read_trace(path, speedup=2.0)
    assert [r.at_s for r in reqs] == [0.0, 0.25, 0.75]
    assert [r.prompt_tokens for r in reqs] == [1100, 700, 1024]
    assert [r.output_tokens for r in reqs] == [20, 30, 5]
    assert reqs[0].segments[0] == reqs[1].segments[0] == reqs[2].segments[0]
    assert reqs[0].segments[1] == reqs[2].segments[1]
    assert reqs[0].segments[2].length == 1100 - 1024
    # Request 2 shares 512 tokens with request 1, request 3 all of its 1024 (less one block).
    rate = ideal_hit_rate(reqs, vocab.ids)
    assert rate == pytest.approx((512 + 1024 - ENGINE_BLOCK) / (1100 + 700 + 1024))
    assert demand_tokens(None, reqs) == 1100 + 700 - 512


def test_azure_trace_is_unique_prompts(tmp_path: Path, vocab: Vocab) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n")
    reqs = read_azure(path)
    assert [r.prompt_tokens for r in reqs] == [374, 396]
    assert [r.output_tokens for r in reqs] == [44, 109]
    assert reqs[1].at_s == pytest.approx(4.314579, abs=1e-5)
    assert ideal_hit_rate(reqs, vocab.ids) == 0.0


def test_shipped_synthetic_trace_parses_and_shares_prefixes(vocab: Vocab) -> None:
    from kvyard.bench.route import SYNTHETIC_TRACE

    reqs = read_mooncake(SYNTHETIC_TRACE)
    assert len(reqs) >= 100
    assert 0.2 < ideal_hit_rate(reqs, vocab.ids) < 1.0
    assert synthetic_mooncake(5, 1.0, seed=1) == synthetic_mooncake(5, 1.0, seed=1)
