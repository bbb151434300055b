"""Every Redis kvyard starts is a bounded LRU cache, and the Redis tier takes Redis's
evictions in its stride: an evicted block is a miss, never an error or a wrong block."""
from __future__ import annotations

import os

import redis

from kvyard.kvstore import KVLayout, KVStore, Namespace
from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES
from kvyard.kvstore.redis_server import RedisServer
from kvyard.kvstore.redis_tier import RedisTier


def test_servers_kvyard_starts_are_capped_with_lru(redis_server) -> None:
    raw = redis.Redis(port=redis_server.port, password=redis_server.password)
    try:
        assert raw.config_get("maxmemory") == {"maxmemory": str(DEFAULT_MAX_MEMORY_BYTES)}
        assert raw.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    finally:
        raw.close()


def test_evictions_under_a_tiny_cap_are_misses_never_errors() -> None:
    cap = 2 << 20
    layout = KVLayout("bfloat16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)
    ns = Namespace("evict@0", layout)  # 32 KiB blocks: 8 MiB a round, 4x the cap
    with RedisServer(password="evict-pw", max_memory_bytes=cap) as rs:
        red = RedisTier(rs.url, password=rs.password, timeout_s=5.0)
        st = KVStore(ns, redis=red, queue_blocks=4096)
        raw = redis.Redis(port=rs.port, password=rs.password)
        written: dict[int, bytes] = {}
        try:
            for r in range(8):
                hashes = list(range(r * 256 + 1, r * 256 + 257))
                blocks = [os.urandom(layout.nbytes) for _ in hashes]
                assert st.put(hashes, blocks) == len(hashes)
                assert st.flush()
                written.update(zip(hashes, blocks))
                assert raw.info("memory")["used_memory"] <= cap
            assert raw.info("stats")["evicted_keys"] > 0
            assert st.dropped_writes == 0 and red.stats.errors == 0
            hashes = sorted(written)
            got = st.get(hashes)
            hits = [h for h, v in zip(hashes, got) if v is not None]
            assert all(bytes(v) == written[h] for h, v in zip(hashes, got) if v is not None)
            assert 0 < len(hits) < len(hashes)  # the newest survive, the rest are misses
            outs = [bytearray(layout.nbytes) for _ in hashes]
            n = st.get_into(hashes, outs)  # a leading run: stops at the first evicted block
            assert [bytes(o) for o in outs[:n]] == [written[h] for h in hashes[:n]]
            assert red.stats.errors == 0 and red.available
        finally:
            raw.close()
            st.close()
