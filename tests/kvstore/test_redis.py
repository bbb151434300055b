"""Redis tier against a real redis-server with a password: hits, faults, recovery."""
from __future__ import annotations

import time

import pytest
import redis

from kvyard.kvstore import KVStore
from kvyard.kvstore.dram import DramTier
from kvyard.kvstore.redis_server import RedisServer, free_port
from kvyard.kvstore.redis_tier import RedisTier
from kvyard.kvstore.ssd import SsdTier

FAST = dict(timeout_s=0.2, backoff_s=(0.05, 0.2))


def _tier(url: str, password: str, **kw) -> RedisTier:
    return RedisTier(url, password=password, prefix="t:", **(FAST | kw))


def test_put_get_lookup_with_password_and_ttl(ns, layout, make_blocks, redis_server):
    red = _tier(redis_server.url, redis_server.password, ttl_s=600)
    st = KVStore(ns, redis=red)
    blocks = make_blocks(3)
    st.put([1, 2, 3], blocks)
    assert st.flush()
    assert st.lookup([1, 2, 3, 4]) == (3, ["redis"] * 3)
    assert [bytes(b) for b in st.get([1, 2, 3])] == blocks
    raw = redis.Redis(port=redis_server.port, password=redis_server.password)
    ttl = raw.ttl(red.rkey(ns.key(1)))
    assert 0 < ttl <= 600
    assert red.stats.hits == 3 and red.stats.errors == 0
    wrong = _tier(redis_server.url, "not-the-password")
    assert wrong.get_many([ns.key(1)], layout) == [None] and wrong.stats.errors == 1
    raw.close()
    st.close()


def test_hit_is_promoted_to_dram_and_ssd(ns, layout, make_blocks, redis_server, tmp_path):
    writer = KVStore(ns, redis=_tier(redis_server.url, redis_server.password))
    blocks = make_blocks(2)
    writer.put([1, 2], blocks)
    assert writer.flush()
    reader = KVStore(ns, dram=DramTier(1 << 20), ssd=SsdTier(tmp_path, 1 << 20),
                     redis=_tier(redis_server.url, redis_server.password))
    assert reader.lookup([1, 2]) == (2, ["redis", "redis"])
    assert [bytes(b) for b in reader.get([1, 2])] == blocks
    assert reader.flush()
    assert reader.lookup([1, 2]) == (2, ["dram", "dram"])
    reader.dram.discard(ns.key(1))
    assert reader.lookup([1]) == (1, ["ssd"])
    writer.close()
    reader.close()


def test_corrupt_value_is_detected_deleted_and_not_returned(ns, layout, make_blocks,
                                                            redis_server):
    red = _tier(redis_server.url, redis_server.password)
    st = KVStore(ns, redis=red)
    st.put([1, 2], make_blocks(2))
    assert st.flush()
    raw = redis.Redis(port=redis_server.port, password=redis_server.password)
    v = bytearray(raw.get(red.rkey(ns.key(1))))
    v[-1] ^= 0x01
    raw.set(red.rkey(ns.key(1)), bytes(v))
    raw.set(red.rkey(ns.key(2)), b"short")
    assert st.get([1, 2]) == [None, None]
    assert red.stats.errors == 2 and red.stats.misses == 2
    assert raw.exists(red.rkey(ns.key(1)), red.rkey(ns.key(2))) == 0
    raw.close()
    st.close()


def test_unreachable_at_start_then_reconnects(ns, layout, make_blocks, tmp_path, wait_until):
    port = free_port()
    password = "later-pw"
    red = _tier(f"redis://127.0.0.1:{port}/0", password)
    st = KVStore(ns, dram=DramTier(1 << 20), ssd=SsdTier(tmp_path, 1 << 20), redis=red)
    blocks = make_blocks(3)
    t0 = time.monotonic()
    st.put([1, 2, 3], blocks)
    assert st.flush()
    assert st.lookup([1, 2, 3]) == (3, ["dram"] * 3)
    st.dram.discard(ns.key(1))
    assert bytes(st.get([1])[0]) == blocks[0]  # served by SSD
    assert st.get([9]) == [None]
    assert time.monotonic() - t0 < 5.0  # failing fast, not waiting on sockets
    assert red.stats.errors >= 1 and not red.available
    with RedisServer(port=port, password=password) as rs:
        def landed() -> bool:
            st.put([4], make_blocks(1))
            st.flush()
            return red.contains_many([ns.key(4)]) == [True]
        wait_until(landed, timeout=20, what="redis tier to reconnect")
        assert red.available
        raw = redis.Redis(port=rs.port, password=password)
        assert raw.exists(red.rkey(ns.key(4))) == 1
        raw.close()
    st.close()


def test_killed_mid_run_then_restarted(ns, layout, make_blocks, tmp_path, wait_until):
    port = free_port()
    pw = "mid-run-pw"
    red = _tier(f"redis://127.0.0.1:{port}/0", pw)
    st = KVStore(ns, dram=DramTier(1 << 20), ssd=SsdTier(tmp_path, 1 << 20), redis=red)
    blocks = make_blocks(4)
    with RedisServer(port=port, password=pw):
        st.put([1, 2], blocks[:2])
        assert st.flush()
        assert red.contains_many([ns.key(1), ns.key(2)]) == [True, True]
    # redis-server is gone now
    errors_before = red.stats.errors
    t0 = time.monotonic()
    st.put([3], blocks[2:3])
    assert st.flush()
    assert st.lookup([1, 2, 3]) == (3, ["dram"] * 3)
    for k in (1, 2, 3):
        st.dram.discard(ns.key(k))
    assert [bytes(b) for b in st.get([1, 2, 3])] == blocks[:3]  # SSD still serves
    assert time.monotonic() - t0 < 5.0
    assert red.stats.errors > errors_before and not red.available
    with RedisServer(port=port, password=pw):
        def back() -> bool:
            st.put([4], blocks[3:4])
            st.flush()
            return red.contains_many([ns.key(4)]) == [True]
        wait_until(back, timeout=20, what="redis tier to reconnect after a restart")
        assert red.available
    st.close()


def test_get_into_redis_only_reads_into_outs_and_rejects_corrupt(ns, layout, make_blocks,
                                                                 redis_server):
    """Redis-only store: values are read from the socket straight into the caller's
    buffers (in parts, the next in flight); bad checksums, wrong keys and wrong
    lengths are deleted, counted, zeroed and never reported filled."""
    red = _tier(redis_server.url, redis_server.password, timeout_s=2.0)
    st = KVStore(ns, redis=red)
    n = 40  # more than two MGET parts: exercises the overlapped fetches
    blocks = make_blocks(n)
    st.put(list(range(1, n + 1)), blocks)
    assert st.flush()
    outs = [bytearray(layout.nbytes) for _ in range(n)]
    assert st.get_into(list(range(1, n + 1)), outs) == n
    assert [bytes(o) for o in outs] == blocks
    raw = redis.Redis(port=redis_server.port, password=redis_server.password)
    v = bytearray(raw.get(red.rkey(ns.key(5))))
    v[-1] ^= 0x01
    raw.set(red.rkey(ns.key(5)), bytes(v))
    raw.set(red.rkey(ns.key(7)), b"short")
    raw.set(red.rkey(ns.key(9)), raw.get(red.rkey(ns.key(10))))  # another key's block
    raw.delete(red.rkey(ns.key(11)))
    red.stats.hits = red.stats.misses = red.stats.errors = 0
    outs = [bytearray(layout.nbytes) for _ in range(n)]
    got = st.get_into(list(range(1, n + 1)), outs)
    assert got == 4, (got, red.stats.as_dict())
    assert [bytes(o) for o in outs[:4]] == blocks[:4]
    assert bytes(outs[4]) == bytes(layout.nbytes)  # the corrupt one was zeroed
    assert [bytes(outs[i]) for i in range(11, n)] == blocks[11:]
    assert red.stats.errors == 3 and red.stats.misses == 4 and red.stats.hits == n - 4
    assert raw.exists(*(red.rkey(ns.key(k)) for k in (5, 7, 9))) == 0
    assert st.get_into([1, 2], outs[:2]) == 2  # the connection is still in step
    raw.close()
    st.close()


@pytest.mark.parametrize("dims,count", [((32, 8, 128), 5), ((30, 3, 64), 23)])
def test_put_checksums_run_a_group_ahead_and_every_header_is_right(redis_server, dims, count):
    """Checksums run on a helper thread a group (~GROUP_BYTES) ahead of the send,
    the first group on the sender: 2 MiB blocks one per group, 360 KiB blocks five
    (23 blocks: a short last group). Every header must still be right (read back
    verified), whichever thread wrote it."""
    import os

    from kvyard.kvstore import KVLayout, Namespace
    from kvyard.kvstore.codec import HEADER_BYTES
    from kvyard.kvstore.redis_tier import GROUP_BYTES

    layout = KVLayout("bfloat16", 16, *dims)
    assert count * layout.nbytes > 2 * GROUP_BYTES  # at least three groups
    ns = Namespace("model-groups@0123", layout)
    red = _tier(redis_server.url, redis_server.password, timeout_s=5.0)
    st = KVStore(ns, redis=red)
    keys = list(range(1, count + 1))
    frames = [bytearray(HEADER_BYTES) + os.urandom(layout.nbytes) for _ in keys]
    assert st.put(keys, frames) == count
    assert st.flush()
    assert red._ahead is not None  # the helper thread did some of the checksums
    outs = [bytearray(layout.nbytes) for _ in keys]
    assert st.get_into(keys, outs) == count
    assert [bytes(o) for o in outs] == [bytes(f[HEADER_BYTES:]) for f in frames]
    assert red.stats.errors == 0 and red.stats.hits == count
    st.close()
