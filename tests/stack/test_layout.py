"""The local stack's store layout: DRAM + one pool tier, never two; the pool tier
serves a block one worker wrote to another; the Redis it starts is capped.

Stand-in workers take the real worker's `--kv-*` flags and run a real store, one
small block per request (`x-standin-kv` says where a request's block was found)."""
from __future__ import annotations

from pathlib import Path

import redis as redis_py

from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES
from kvyard.stack import commands
from kvyard.stack.spec import REDIS_PASSWORD_ENV, StackSpec
from kvyard.stack.state import STATE_FILE


def _workers(state):
    return [p for p in state.procs if p.name.startswith("worker")]


def _direct(h, address: str, text: str):
    r = h.request(f"http://{address}", h.chat_body(text))
    assert r.status == 200, r.body
    return r.headers["x-standin-kv"]


def test_default_layout_is_dram_and_the_shared_ssd_without_redis(up, h, wait_until) -> None:
    state = up("--workers", "2")
    assert "redis" not in {p.name for p in state.procs}
    assert state.spec["kv_pool_tier"] == "ssd"
    for w in _workers(state):
        assert "--kv-dram-gb" in w.cmd and "--kv-ssd-dir" in w.cmd
        assert "--kv-redis-url" not in w.cmd
    a, b = state.endpoints
    assert _direct(h, a, "layout ssd") == "miss"  # a writes the block
    ssd = Path(state.run_dir) / "kvcache"
    wait_until(lambda: any(ssd.rglob("*.kvb")), timeout=10, what="a's block on the SSD tier")
    assert _direct(h, b, "layout ssd") == "ssd"  # b reads what a wrote: pool-wide
    assert _direct(h, a, "layout ssd") == "dram"


def test_redis_layout_has_no_ssd_and_a_capped_authenticated_redis(up, h, wait_until) -> None:
    state = up("--workers", "2", "--kv-redis")
    assert state.spec["kv_pool_tier"] == "redis"
    rproc = next(p for p in state.procs if p.name == "redis")
    run = Path(state.run_dir)
    password = (run / "redis.password").read_text().strip()
    assert (run / "redis.password").stat().st_mode & 0o077 == 0
    assert password not in (run / STATE_FILE).read_text()
    for w in _workers(state):
        assert "--kv-redis-url" in w.cmd and "--kv-ssd-dir" not in w.cmd
        assert not any(password in a for a in w.cmd)
        assert w.env_files == {REDIS_PASSWORD_ENV: str(run / "redis.password")}
    client = redis_py.Redis(port=rproc.ports["redis"], password=password, socket_timeout=5)
    try:
        assert client.config_get("maxmemory") == {"maxmemory": str(DEFAULT_MAX_MEMORY_BYTES)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        a, b = state.endpoints
        assert _direct(h, a, "layout redis") == "miss"
        wait_until(lambda: client.dbsize() >= 1, timeout=10, what="a's block in Redis")
        assert _direct(h, b, "layout redis") == "redis"
    finally:
        client.close()
    assert not (run / "kvcache").exists()


def test_layout_flags_without_starting_anything(tmp_path: Path) -> None:
    spec = StackSpec(run_dir=tmp_path, kv_pool_tier="redis", kv_redis_max_memory=64 << 20)
    args, env_files, services = commands.kv_layout(spec, tmp_path, set())
    assert [s.name for s in services] == ["redis"] and "--kv-ssd-dir" not in args
    conf = (tmp_path / "redis.conf").read_text().splitlines()
    assert f"maxmemory {64 << 20}" in conf and "maxmemory-policy allkeys-lru" in conf
    assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0
    assert set(env_files) == {REDIS_PASSWORD_ENV}
    none = commands.kv_layout(StackSpec(run_dir=tmp_path, kv_pool_tier="none"), tmp_path, set())
    assert none == (["--kv-dram-gb", "1.0"], {}, [])
    off = commands.kv_layout(StackSpec(run_dir=tmp_path, kv_tiers=False), tmp_path, set())
    assert off == ([], {}, [])
