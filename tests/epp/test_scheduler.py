"""Filters, scorers and the picker on real Endpoint objects."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from kvyard.common.hashing import block_hashes
from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec
from kvyard.epp.prompt import LazyPrompt
from kvyard.epp.saturation import pool_saturation
from kvyard.epp.scheduling.config import build_scheduler
from kvyard.epp.scheduling.prefix_index import PrefixIndex
from kvyard.epp.scheduling.scorers.queue import QueueScorer
from kvyard.epp.scheduling.types import SchedRequest


def _pool(n: int, **metrics) -> EndpointPool:
    pool = EndpointPool()
    pool.set_source("t", [EndpointSpec(f"10.0.0.{i}:8000") for i in range(1, n + 1)])
    for e in pool.all():
        e.last_ok = time.monotonic()
        for k, v in metrics.items():
            setattr(e, k, v)
    return pool


def _req(hashes=(), priority=0) -> SchedRequest:
    return SchedRequest("m", LazyPrompt.of_hashes(list(hashes)), priority, time.monotonic())


def _lazy(hashes) -> LazyPrompt:
    return LazyPrompt.of_hashes(list(hashes))


def test_prefix_affinity_sticks_to_the_endpoint_that_saw_the_prefix():
    pool = _pool(8)
    sched = build_scheduler(seed=1)
    shared = list(range(64 * 20))
    first = sched.schedule(_req(block_hashes(shared + [1] * 64, 64)), pool.all())
    assert first.matched_blocks == 0
    for e in pool.all():
        e.pending = 0  # as if a scrape had happened
    for tail in range(2, 12):
        d = sched.schedule(_req(block_hashes(shared + [tail] * 64, 64)), pool.all())
        assert d.endpoint is first.endpoint
        assert d.matched_blocks == 20 and d.total_blocks == 21
        first.endpoint.pending = 0


def test_deep_queue_is_avoided_even_with_prefix_match():
    pool = _pool(3)
    sched = build_scheduler(seed=1)
    hashes = block_hashes(list(range(640)), 64)
    busy = pool.all()[0]
    sched.prefix_scorer.index.record(busy.address, hashes)
    busy.waiting, busy.kv_usage = 50, 0.95
    picks = {sched.schedule(_req(hashes), pool.all()).endpoint.address for _ in range(20)}
    assert busy.address not in picks


def test_queue_score_formula_and_all_equal():
    pool = _pool(3)
    for e, q in zip(pool.all(), (0, 5, 10)):
        e.waiting = q
    assert QueueScorer().score(_req(), pool.all()) == [1.0, 0.5, 0.0]
    for e in pool.all():
        e.waiting = 4
    assert QueueScorer().score(_req(), pool.all()) == [1.0, 1.0, 1.0]


def test_ties_are_broken_at_random():
    pool = _pool(4)
    sched = build_scheduler(seed=7)
    counts = Counter()
    for _ in range(400):
        d = sched.schedule(_req(), pool.all())
        counts[d.endpoint.address] += 1
        d.endpoint.pending = 0
    assert len(counts) == 4 and min(counts.values()) > 50


def test_picks_since_last_scrape_spread_a_burst():
    pool = _pool(4)
    sched = build_scheduler(seed=3)
    picked = Counter(sched.schedule(_req(), pool.all()).endpoint.address for _ in range(8))
    assert sorted(picked.values()) == [2, 2, 2, 2]


def test_down_endpoints_are_never_picked_and_stale_ones_lose():
    pool = _pool(3)
    a, b, c = pool.all()
    a.down = True
    b.last_ok = time.monotonic() - 10  # stale
    sched = build_scheduler(seed=1)
    assert {sched.schedule(_req(), pool.all()).endpoint.address for _ in range(20)} == {c.address}
    c.down = True
    assert sched.schedule(_req(), pool.all()).endpoint is b  # stale still serves
    b.down = True
    assert sched.schedule(_req(), pool.all()) is None


def test_prefill_only_endpoints_are_not_destinations():
    pool = EndpointPool()
    pool.set_source("t", [EndpointSpec("10.0.0.1:1", "prefill"), EndpointSpec("10.0.0.2:1", "decode")])
    for e in pool.all():
        e.last_ok = time.monotonic()
    sched = build_scheduler(seed=1)
    assert {sched.schedule(_req(), pool.all()).endpoint.role for _ in range(10)} == {"decode"}


def test_prefix_index_is_bounded_lru_and_forgets_removed_endpoints():
    idx = PrefixIndex(capacity=10)
    idx.record("a", list(range(8)))
    idx.record("a", list(range(100, 105)))  # evicts the 3 oldest: 0, 1, 2
    assert idx.size("a") == 10
    assert idx.match("a", _lazy(range(8))) == 0  # chain broken at block 0
    assert idx.match("a", _lazy(list(range(100, 105)) + [2, 7])) == 5  # 2 was evicted
    pool = _pool(2)
    sched = build_scheduler()
    pool.on_remove(sched.forget)
    addr = pool.all()[0].address
    sched.prefix_scorer.index.record(addr, [1, 2, 3])
    pool.set_source("t", [EndpointSpec(pool.all()[1].address)])
    assert sched.prefix_scorer.index.match(addr, _lazy([1, 2, 3])) == 0


def test_saturation_and_config_validation():
    pool = _pool(2)
    a, b = pool.all()
    a.waiting, b.kv_usage = 5, 0.4  # 1.0 and 0.5
    assert pool_saturation(pool.all()) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        build_scheduler({"scorers": [{"type": "nope"}]})
    s = build_scheduler({"scorers": [{"type": "queue", "weight": 1}], "objectives": {"batch": -1}})
    assert s.prefix_scorer is None and s.objectives == {"batch": -1}


def test_example_config_is_the_default_pipeline():
    from pathlib import Path

    import kvyard.epp
    from kvyard.epp.scheduling.config import load_config
    path = Path(kvyard.epp.__file__).parent / "scheduler.example.yaml"
    s = build_scheduler(load_config(path))
    assert [f.name for f in s.filters] == ["healthy", "prefer-fresh", "role"]
    assert [(sc.name, w) for sc, w in s.scorers] == [
        ("prefix-cache", 3.0), ("queue", 2.0), ("kv-cache-utilization", 2.0),
        ("lora-affinity", 4.0)]
    assert s.block_size == 64 and s.objectives == {"batch": -1, "interactive": 0}
