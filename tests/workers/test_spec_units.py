"""Speculative decoding's parts without a model: n-gram lookup, greedy acceptance, the
rejection sampler's output distribution (a chi-square test on a small vocabulary), the
target distribution it samples, the auto policy, the config's errors."""
from __future__ import annotations

import pytest
import torch

from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.spec.config import SpeculativeConfig
from kvyard.workers.engine.spec.ngram import NgramProposer
from kvyard.workers.engine.spec.policy import SpecPolicy, SpecState
from kvyard.workers.engine.spec.stats import SpecDecodeStats
from kvyard.workers.engine.spec.verify import accept_greedy, rejection_sample, target_probs


def test_ngram_proposes_what_followed_the_latest_match():
    prop = NgramProposer(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=2))
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    assert prop.propose(seq, 3) == [7, 8, 6]           # [2, 3] last seen before 7
    assert prop.propose(seq, 1) == [7]
    assert prop.propose([5, 6, 7, 8], 4) == []          # no repetition, no draft
    # the longest n wins: [1, 2, 3] matches at the start though [2, 3] is more recent
    assert prop.propose([1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3], 2) == [4, 0]
    assert prop.propose([4, 4, 4, 4], 3) == [4]         # the match's continuation runs out


def test_greedy_acceptance_is_the_longest_agreeing_prefix_plus_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 99.9th percentile of chi-square with 5 degrees of freedom (6 tokens)
CHI2_5_999 = 20.52


@pytest.mark.parametrize("draft_kind", ["one_hot", "distribution"])
def test_rejection_sampling_leaves_the_target_distribution_unchanged(draft_kind):
    """Whatever the draft proposes, each emitted token is distributed as the target's p,
    at the first position and, given acceptance, at the next."""
    g = torch.Generator().manual_seed(7)
    vocab, trials = 6, 20000
    p = torch.tensor([[0.05, 0.40, 0.25, 0.0, 0.20, 0.10],
                      [0.30, 0.10, 0.10, 0.20, 0.25, 0.05]])
    q_dist = torch.tensor([0.50, 0.05, 0.05, 0.30, 0.05, 0.05])
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        if draft_kind == "one_hot":   # a deterministic proposer: a token the target may dislike
            x, q = 0, None
        else:                         # a sampling draft model: x ~ q
            x = int(torch.multinomial(q_dist, 1, generator=g))
            q = torch.stack([q_dist])
        out = rejection_sample(p, [x], q, g)
        assert 1 <= len(out) <= 2
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    assert _chi_square(first, p[0]) < CHI2_5_999
    assert _chi_square(second, p[1]) < CHI2_5_999
    # and it is speculation, not just sampling: some drafts were accepted
    assert second.sum() > trials * 0.02


def test_target_probs_follow_temperature_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    full = target_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(full, torch.softmax(logits / 0.5, -1))
    k2 = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (k2[0, 2:] == 0).all() and torch.isclose(k2.sum(), torch.tensor(1.0))
    p = torch.softmax(logits, -1)[0]
    nucleus = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(p[0]) + 1e-3))
    assert (nucleus[0] > 0).tolist() == [True, True, False, False, False]


def test_auto_policy_pauses_a_request_with_low_acceptance_and_probes_again():
    cfg = SpeculativeConfig(min_acceptance=0.5, min_drafts=2, pause_steps=3)
    pol, st = SpecPolicy(cfg), SpecState()
    pol.record(st, 4, 0)
    assert pol.wants_draft(st)                    # one draft is not enough evidence
    pol.record(st, 4, 1)
    assert [pol.wants_draft(st) for _ in range(4)] == [False, False, False, True]
    good = SpecState()
    for _ in range(5):
        pol.record(good, 4, 3)
    assert pol.wants_draft(good)
    always = SpecPolicy(SpeculativeConfig(policy="always", min_drafts=1))
    bad = SpecState()
    always.record(bad, 4, 0)
    assert always.wants_draft(bad)


def test_the_gate_drafts_where_drafting_has_been_faster_and_keeps_checking():
    from kvyard.workers.engine.spec.policy import EXPLORE, MIN_STEPS, BatchGate

    gate = BatchGate()
    assert [gate.bucket(r) for r in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]

    def run(rows, spec_rate, plain_rate, steps=64):
        """Steps of `rows` rows at the given tokens/s per arm; which arm each step chose."""
        chose = []
        for _ in range(steps):
            drafted = gate.allow(rows)
            chose.append(drafted)
            gate.observe(rows, drafted, 10, 10 / (spec_rate if drafted else plain_rate))
        return chose

    slow = run(8, spec_rate=50.0, plain_rate=100.0)      # batch 8: drafting loses
    assert all(slow[:MIN_STEPS])                         # it learns what drafting gives first
    tail = slow[-EXPLORE:]
    assert sum(tail) == 1                                 # one probe in EXPLORE steps
    fast = run(1, spec_rate=150.0, plain_rate=100.0)      # batch 1: drafting wins
    assert sum(fast[-EXPLORE:]) == EXPLORE - 1            # one plain step in EXPLORE
    assert SpecPolicy(SpeculativeConfig(policy="always")).step_allows(8)


def test_stats_count_per_position():
    s = SpecDecodeStats()
    s.record(3, 2)
    s.record(4, 0)
    s.record(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 4)
    assert s.accepted_per_pos == [2, 2, 0, 0]
    assert s.mean_accepted_length == pytest.approx(1 + 4 / 3)


@pytest.mark.parametrize("raw, msg", [
    ('{"method": "medusa"}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "draft_model"}', "model"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup"),
    ('{"method": "ngram", "bogus": 1}', "unknown"),
    ('[1, 2]', "object"),
    ('{"method": ', "JSON"),
])
def test_bad_configs_are_refused_with_the_reason(raw, msg):
    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig.parse(raw)


def test_worker_flag_takes_vllms_json_and_refuses_bad_json():
    import argparse

    from kvyard.workers.server.cli import add_arguments, engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", '{"method": "eagle"}'])
