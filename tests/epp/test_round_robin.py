"""The round-robin picker: candidates in turn (ties in turn when scorers are configured),
its typed config, and fallbacks best first."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec
from kvyard.epp.prompt import LazyPrompt
from kvyard.epp.scheduling.config import build_scheduler, with_fallbacks
from kvyard.epp.scheduling.plugin_config import ConfigError
from kvyard.epp.scheduling.types import SchedRequest


def _pool(n: int) -> EndpointPool:
    pool = EndpointPool()
    pool.set_source("t", [EndpointSpec(f"10.0.3.{i}:8000") for i in range(1, n + 1)])
    for e in pool.all():
        e.last_ok = time.monotonic()
    return pool


def _req() -> SchedRequest:
    return SchedRequest("m", LazyPrompt.of_hashes([1, 2]), now=time.monotonic())


def test_no_scorers_visits_every_endpoint_in_a_fixed_cycle():
    s = build_scheduler({"scorers": [], "picker": {"type": "round-robin"}}, seed=1)
    eps = _pool(4).all()
    picks = [s.schedule(_req(), eps).endpoint.address for _ in range(12)]
    assert picks[:4] == [e.address for e in eps]          # each once, in the pool's order
    assert picks[4:8] == picks[:4] == picks[8:]           # then the same cycle again
    assert set(Counter(picks).values()) == {3}


def test_scores_first_then_ties_in_turn_and_fallbacks_best_first():
    s = build_scheduler({"scorers": [{"type": "queue", "weight": 1}],
                         "picker": {"type": "round-robin", "maxEndpoints": 3}}, seed=1)
    eps = _pool(4).all()
    for e, q in zip(eps, (0, 0, 20, 10)):
        e.waiting = q
    d1, d2, d3 = (s.schedule(_req(), eps) for _ in range(3))
    assert [d.endpoint for d in (d1, d2, d3)] == [eps[0], eps[1], eps[0]]  # the two idle ones
    assert [e.waiting for e in d1.fallbacks] == [0, 10]                    # then best first


def test_a_pool_that_changes_size_keeps_rotating():
    s = build_scheduler({"scorers": [], "picker": {"type": "round-robin"}}, seed=1)
    eps = _pool(3).all()
    first = [s.schedule(_req(), eps).endpoint.address for _ in range(2)]
    two = eps[:2]
    later = [s.schedule(_req(), two).endpoint.address for _ in range(4)]
    assert first == [e.address for e in two]
    assert sorted(later) == sorted([e.address for e in two] * 2) and later[0] != later[1]


def test_round_robin_config_is_validated_and_takes_fallbacks():
    with pytest.raises(ConfigError) as e:
        build_scheduler({"picker": {"type": "round-robin", "maxEndpoints": 0}})
    assert e.value.path == "profiles.default.picker.maxEndpoints"
    with pytest.raises(ConfigError) as e:
        build_scheduler({"picker": {"type": "round-robin", "turn": 2}})
    assert "unknown parameter" in str(e.value)
    s = build_scheduler(with_fallbacks({"scorers": [], "picker": {"type": "round-robin"}}, 2))
    d = s.schedule(_req(), _pool(3).all())
    assert s.primary.picker.name == "round-robin" and len(d.fallbacks) == 2
