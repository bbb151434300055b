"""Plugins: typed hook protocols, the registry, score clamping and typed cycle-state keys."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import pytest

from kvyard.epp.pool.endpoints import Endpoint, EndpointPool, EndpointSpec
from kvyard.epp.prompt import LazyPrompt
from kvyard.epp.scheduling import registry
from kvyard.epp.scheduling.config import build_scheduler
from kvyard.epp.scheduling.cycle import CycleState, StateKey
from kvyard.epp.scheduling.hooks import PreRequest, Scorer
from kvyard.epp.scheduling.pickers import MaxScorePicker
from kvyard.epp.scheduling.plugin_config import ConfigError, NoParams
from kvyard.epp.scheduling.profile import SchedulingProfile
from kvyard.epp.scheduling.types import SchedRequest


def _eps(n: int) -> list[Endpoint]:
    pool = EndpointPool()
    pool.set_source("t", [EndpointSpec(f"10.0.2.{i}:8000") for i in range(1, n + 1)])
    for e in pool.all():
        e.last_ok = time.monotonic()
    return pool.all()


def test_a_misspelt_hook_cannot_be_built():
    @dataclass(slots=True)
    class Sloppy(Scorer, PreRequest):
        name: str = "sloppy"

        def score(self, req, eps):
            return [0.0] * len(eps)

        def pre_requst(self, req, ep):  # the typo: PreRequest.pre_request stays abstract
            pass

    with pytest.raises(TypeError, match="pre_request"):
        Sloppy()


def test_every_registered_plugin_implements_its_kind_and_builds_with_defaults():
    for kind, (table, protocol) in registry.KINDS.items():
        for name, t in table.items():
            if protocol is not None:
                assert protocol in t.cls.__mro__, (kind, name)  # subclassed: hooks checked
            plugin = t.build(t.params())
            assert plugin.name == name and t.doc, (kind, name)
    assert registry.SCORERS["queue"].params is NoParams


def test_a_new_scorer_is_one_class_and_one_registry_line(monkeypatch):
    @dataclass(slots=True)
    class FewestRunning(Scorer):
        """Fewer running requests score higher."""

        name: str = "fewest-running"

        def score(self, req, eps):
            return [1.0 / (1 + e.running) for e in eps]

    monkeypatch.setitem(registry.SCORERS, "fewest-running", registry.PluginType(FewestRunning))
    s = build_scheduler({"scorers": [{"type": "fewest-running", "weight": 1}]}, seed=1)
    eps = _eps(3)
    for e, r in zip(eps, (4, 0, 9)):
        e.running = r
    assert s.schedule(SchedRequest("m", LazyPrompt.of_hashes([])), eps).endpoint is eps[1]
    with pytest.raises(ConfigError, match="unknown parameter"):
        build_scheduler({"scorers": [{"type": "fewest-running", "depth": 1}]})


def test_scores_are_clamped_to_0_1_before_weighting():
    @dataclass(slots=True)
    class Wild(Scorer):
        values: list[float]
        name: str = "wild"

        def score(self, req, eps):
            return self.values

    eps = _eps(4)
    prof = SchedulingProfile("p", [], [(Wild([-5.0, 7.0, math.nan, 0.25]), 2.0)],
                             MaxScorePicker(4))
    r = prof.run(SchedRequest("m", LazyPrompt.of_hashes([])), eps, random.Random(0))
    assert r.endpoints == [eps[1], eps[3], eps[0], eps[2]]  # -5 and NaN count as 0
    assert r.score == 2.0  # 7 counted as 1, weighted by 2


def test_cycle_state_keys_are_typed_objects():
    a: StateKey[int] = StateKey("x/count")
    b: StateKey[int] = StateKey("x/count")  # same name, another key: no collision
    cs = CycleState()
    cs.write(a, 3)
    assert cs.read(a) == 3 and cs.read(b) is None and cs.read(b, 0) == 0
