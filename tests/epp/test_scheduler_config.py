"""The scheduler config is validated when it loads, with the path of each mistake;
the lifecycle's pieces (cycle state, picker fallbacks, hooks) behave as documented."""
from __future__ import annotations

import time

import pytest

from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec
from kvyard.epp.prompt import LazyPrompt
from kvyard.epp.scheduling.config import build_scheduler
from kvyard.epp.scheduling.cycle import PREFIX_MATCHES
from kvyard.epp.scheduling.plugin_config import ConfigError
from kvyard.epp.scheduling.types import SchedRequest


@pytest.mark.parametrize("cfg,path,text", [
    ({"scorer": []}, "scorer", "unknown key"),
    ({"scorers": [{"type": "nope"}]}, "profiles.default.scorers[0]", "unknown scorer 'nope'"),
    ({"scorers": [{"type": "queue", "weight": "x"}]}, "profiles.default.scorers[0].weight",
     "number >= 0"),
    ({"scorers": [{"type": "queue", "weight": -1}]}, "profiles.default.scorers[0].weight", ">= 0"),
    ({"scorers": [{"type": "prefix-cache", "lruCapacityPerServer": 0}]},
     "profiles.default.scorers[0].lruCapacityPerServer", ">= 1"),
    ({"scorers": [{"type": "prefix-cache", "blockSize": 16}]},
     "profiles.default.scorers[0].blockSize", "unknown parameter"),
    ({"scorers": [{"type": "queue", "depth": 2}]}, "profiles.default.scorers[0].depth",
     "no parameters"),
    ({"scorers": ["queue"]}, "profiles.default.scorers[0]", "mapping"),
    ({"filters": ["healthy", "nope"]}, "profiles.default.filters[1]", "unknown filter"),
    ({"picker": {"type": "max-score", "maxEndpoints": 99}}, "profiles.default.picker.maxEndpoints",
     "<= 16"),
    ({"picker": {"type": "roulette"}}, "profiles.default.picker", "unknown picker"),
    ({"profiles": {"a": {"filters": []}, "b": {"filters": []}}}, "profiles",
     "exactly one profile"),
    ({"profiles": {"a": {"scorer": []}}}, "profiles.a.scorer", "unknown key"),
    ({"profiles": {"a": {}}, "filters": []}, "filters", "inside `profiles`"),
    ({"profileHandler": {"type": "nope"}}, "profileHandler", "unknown profile handler"),
    ({"blockSize": 0}, "blockSize", ">= 1"),
    ({"blockSize": True}, "blockSize", "integer"),
    ({"objectives": {"batch": "low"}}, "objectives.batch", "integer priority"),
])
def test_config_errors_name_their_path(cfg, path, text):
    with pytest.raises(ConfigError) as e:
        build_scheduler(cfg)
    assert e.value.path == path
    assert str(e.value).startswith(path + ":") and text in str(e.value)


def _pool(n: int) -> EndpointPool:
    pool = EndpointPool()
    pool.set_source("t", [EndpointSpec(f"10.0.0.{i}:8000") for i in range(1, n + 1)])
    for e in pool.all():
        e.last_ok = time.monotonic()
    return pool


def test_profiles_form_and_fallbacks_best_first():
    s = build_scheduler({"profiles": {"main": {
        "filters": ["healthy"], "scorers": [{"type": "queue", "weight": 1}],
        "picker": {"type": "max-score", "maxEndpoints": 3}}}}, seed=1)
    pool = _pool(4)
    for e, q in zip(pool.all(), (3, 0, 2, 1)):
        e.waiting = q
    d = s.schedule(SchedRequest("m", LazyPrompt.of_hashes([])), pool.all())
    assert [e.waiting for e in [d.endpoint, *d.fallbacks]] == [0, 1, 2]
    assert d.result.primary == "main" and d.candidates == 4


def test_prefix_matches_reach_the_decision_through_the_cycle_state():
    s = build_scheduler(seed=1)
    pool = _pool(2)
    a = pool.all()[0]
    s.learn(a.address, [11, 12, 13])  # post-response teaching (a PostResponse hook)
    req = SchedRequest("m", LazyPrompt.of_hashes([11, 12, 13, 14]), now=time.monotonic())
    d = s.schedule(req, pool.all())
    assert d.endpoint is a and d.matched_blocks == 3
    assert req.cycle.read(PREFIX_MATCHES) == {a.address: 3, pool.all()[1].address: 0}
    assert a.prefix_hits == 1 and a.pending == 1


def test_hooks_are_found_by_type_on_any_plugin():
    s = build_scheduler({"scorers": [{"type": "queue", "weight": 1}]}, seed=1)
    seen = []

    class Teacher:  # a third-party scorer implementing PostResponse and PoolListener
        name = "teacher"

        def score(self, req, eps):
            return [0.0] * len(eps)

        def learn(self, address, hashes):
            seen.append(("learn", address, hashes))

        def forget(self, address):
            seen.append(("forget", address))

    s.scorers.append((Teacher(), 1.0))
    s.learn("x:1", [1])
    s.forget("x:1")
    assert seen == [("learn", "x:1", [1]), ("forget", "x:1")]


def _roles(*roles: str) -> EndpointPool:
    pool = EndpointPool()
    pool.set_source("t", [EndpointSpec(f"10.0.1.{i}:8000", r) for i, r in enumerate(roles, 1)])
    for e in pool.all():
        e.last_ok = time.monotonic()
    return pool


def _pd_scheduler(**handler):
    from pathlib import Path

    import kvyard.epp
    from kvyard.epp.scheduling.config import load_config
    cfg = load_config(Path(kvyard.epp.__file__).parent / "scheduler.pd.example.yaml")
    cfg["profileHandler"] = {**cfg["profileHandler"], **handler}
    return build_scheduler(cfg, seed=1)


def test_decode_first_picks_a_prefill_pod_for_an_uncached_prompt():
    s = _pd_scheduler(nonCachedTokens=5)  # of_hashes prompts: one token per block
    pool = _roles("prefill", "decode", "prefill")
    long = SchedRequest("m", LazyPrompt.of_hashes(list(range(10))), now=time.monotonic())
    d = s.schedule(long, pool.all())
    assert d.endpoint.role == "decode" and d.prefill is not None and d.prefill.role == "prefill"
    # the decode pod now holds the prompt: a follow-up sharing it is not disaggregated
    s.learn(d.endpoint.address, list(range(10)))
    again = SchedRequest("m", LazyPrompt.of_hashes(list(range(12))), now=time.monotonic())
    d2 = s.schedule(again, pool.all())
    assert d2.endpoint is d.endpoint and d2.matched_blocks == 10 and d2.prefill is None
    short = SchedRequest("m", LazyPrompt.of_hashes([99, 98]), now=time.monotonic())
    assert s.schedule(short, pool.all()).prefill is None


def test_decode_first_without_prefill_pods_or_on_one_both_pod():
    s = _pd_scheduler(nonCachedTokens=0)
    req = SchedRequest("m", LazyPrompt.of_hashes([1, 2, 3]), now=time.monotonic())
    assert s.schedule(req, _roles("decode").all()).prefill is None
    both = _roles("both")
    d = s.schedule(SchedRequest("m", LazyPrompt.of_hashes([1]), now=time.monotonic()), both.all())
    assert d.endpoint.role == "both" and d.prefill is None  # never prefill on the same pod


def test_disagg_handler_needs_its_profiles():
    with pytest.raises(ConfigError) as e:
        build_scheduler({"profileHandler": {"type": "disagg-profile-handler"},
                         "profiles": {"decode": {"filters": ["role"]}}})
    assert e.value.path == "profileHandler.prefillProfile"
