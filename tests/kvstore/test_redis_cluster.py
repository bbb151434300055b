"""The Redis tier against a real 3-master Redis Cluster (redis-server processes on
free ports, formed by redis-cli, password on every node): keys spread over all
masters, corruption caught per node, one master killed mid-run, wrong password.
"""
from __future__ import annotations

import time

import redis

from kvyard.kvstore import KVStore
from kvyard.kvstore.redis_tier import RedisTier

FAST = dict(timeout_s=0.5, backoff_s=(0.05, 0.2))
N = 60  # blocks: with 3 masters, P(one gets none) = 3 * (2/3)^60, about 1e-10


def _tier(rc, password: str | None = None) -> RedisTier:
    return RedisTier(rc.url, password=rc.password if password is None else password,
                     prefix="c:", **FAST)


def _owners(rc, red: RedisTier, keys: list[bytes]) -> list[int]:
    """Index of the master holding each key: every master's own keys, listed by SCAN
    on that master (not through the cluster client's routing)."""
    where: dict[bytes, list[int]] = {}
    for i in range(len(rc.nodes)):
        c = rc.client(i)
        for rk in c.scan_iter(match=red.prefix + "*", count=1000):
            where.setdefault(rk, []).append(i)
        c.close()
    found = [where.get(red.rkey(k), []) for k in keys]
    assert all(len(f) == 1 for f in found), found
    return [f[0] for f in found]


def _filled(rc, ns, make_blocks):
    """A store on the cluster holding blocks 1..N: (tier, store, hashes, blocks, owners)."""
    red = _tier(rc)
    st = KVStore(ns, redis=red)
    blocks = make_blocks(N)
    hashes = list(range(1, N + 1))
    assert st.put(hashes, blocks) == N
    assert st.flush()
    return red, st, hashes, blocks, _owners(rc, red, ns.keys(hashes))


def test_round_trip_spans_all_masters(ns, layout, make_blocks, redis_cluster):
    red, st, hashes, blocks, owners = _filled(redis_cluster, ns, make_blocks)
    assert red.cluster
    assert sorted(set(owners)) == [0, 1, 2]  # every master holds some of them
    assert st.lookup(hashes + [N + 1]) == (N, ["redis"] * N)
    assert [bytes(b) for b in st.get(hashes)] == blocks
    outs = [bytearray(layout.nbytes) for _ in range(N)]
    assert st.get_into(hashes, outs) == N
    assert [bytes(o) for o in outs] == blocks
    assert red.stats.errors == 0 and red.stats.hits == 2 * N
    st.close()


def test_corrupt_values_are_detected_deleted_and_never_returned(ns, layout, make_blocks,
                                                                redis_cluster):
    red, st, hashes, blocks, owners = _filled(redis_cluster, ns, make_blocks)
    keys = ns.keys(hashes)
    # tamper on the masters themselves: a flipped bit, a short value, another key's block
    bad = {3: "flip", 8: "short", 15: "other"}
    for i, how in bad.items():
        c = redis_cluster.client(owners[i])
        rk = red.rkey(keys[i])
        if how == "flip":
            v = bytearray(c.get(rk))
            v[-1] ^= 0x01
            c.set(rk, bytes(v))
        elif how == "short":
            c.set(rk, b"short")
        else:  # a valid block of another key: its header names that key
            src = redis_cluster.client(owners[i + 1])
            c.set(rk, src.get(red.rkey(keys[i + 1])))
            src.close()
        c.close()
    got = st.get(hashes)
    assert [g is None for g in got] == [i in bad for i in range(N)]
    assert [bytes(g) for i, g in enumerate(got) if i not in bad] == \
        [b for i, b in enumerate(blocks) if i not in bad]
    assert red.stats.errors == len(bad) and red.stats.misses == len(bad)
    for i in bad:  # deleted where they were
        c = redis_cluster.client(owners[i])
        assert c.exists(red.rkey(keys[i])) == 0
        c.close()
    # get_into: the same blocks tampered again, caught again, outs of bad ones not filled
    # (read from the socket into outs: a full-length value of another key is caught
    # there and its out zeroed; a short one goes the general way)
    for i in bad:
        c = redis_cluster.client(owners[i])
        if i == 3:
            src = redis_cluster.client(owners[i + 1])
            c.set(red.rkey(keys[i]), src.get(red.rkey(keys[i + 1])))
            src.close()
        else:
            c.set(red.rkey(keys[i]), b"x" * 100)
        c.close()
    outs = [bytearray(b"\xff" * layout.nbytes) for _ in range(N)]
    assert st.get_into(hashes, outs) == min(bad)  # the leading run stops at the first bad
    assert [bytes(o) for o in outs[:min(bad)]] == blocks[:min(bad)]
    assert [bytes(outs[i]) for i in range(N) if i not in bad] == \
        [b for i, b in enumerate(blocks) if i not in bad]  # every good one placed
    assert bytes(outs[3]) == bytes(layout.nbytes)  # the wrong key's bytes never left there
    assert red.stats.errors == 2 * len(bad)
    for i in bad:  # deleted again
        c = redis_cluster.client(owners[i])
        assert c.exists(red.rkey(keys[i])) == 0
        c.close()
    st.close()


def test_master_killed_mid_run(ns, layout, make_blocks, redis_cluster):
    """A master dies: nothing raises; its keys miss (counted); the surviving masters'
    keys are still served and still written, before and after the cluster has
    marked the dead one as failed (`cluster-require-full-coverage no`)."""
    red, st, hashes, blocks, owners = _filled(redis_cluster, ns, make_blocks)
    dead = owners[0]
    redis_cluster.kill(dead)
    alive = [i for i, o in enumerate(owners) if o != dead]
    assert 0 < len(alive) < N

    def check_serves(errors_before: int) -> None:
        got = st.get(hashes)
        assert [g is not None for g in got] == [o != dead for o in owners]
        assert [bytes(got[i]) for i in alive] == [blocks[i] for i in alive]
        n, _ = st.lookup(hashes)
        assert n == 0  # block 0 lives on the dead master: no leading run
        n, tiers = st.lookup([hashes[i] for i in alive])
        assert n == len(alive) and tiers == ["redis"] * n
        assert red.stats.errors > errors_before

    check_serves(0)  # at once, before the cluster has noticed
    more = list(range(N + 1, 2 * N + 1))
    new_blocks = make_blocks(N)
    st.put(more, new_blocks)
    assert st.flush()
    deadline = time.monotonic() + 30
    redis_cluster.wait_state(lambda info: int(info.get("cluster_slots_fail", 0)) > 0,
                             deadline, "the dead master marked as failed")
    check_serves(red.stats.errors)
    got = st.get(more)
    assert sum(g is not None for g in got) > 0  # new blocks landed on the survivors
    assert all(bytes(g) == b for g, b in zip(got, new_blocks) if g is not None)
    st.close()


def test_wrong_password_fails_soft(ns, layout, make_blocks, redis_cluster):
    red = _tier(redis_cluster, password="not-the-password")
    st = KVStore(ns, redis=red)
    hashes = [1, 2, 3]
    assert st.put(hashes, make_blocks(3)) == 3  # queued; the send fails in the background
    assert st.flush()
    assert st.lookup(hashes) == (0, [])
    assert st.get(hashes) == [None] * 3
    outs = [bytearray(layout.nbytes) for _ in range(3)]
    assert st.get_into(hashes, outs) == 0
    assert red.stats.errors >= 1 and red.stats.hits == 0
    assert not red.available
    # the store's threads survived: with the right password the same store works again
    red._opts["password"] = redis_cluster.password  # as if the secret were rotated in
    red._client = None
    red.breaker.success()
    st.put([4], make_blocks(1))
    assert st.flush()
    c = redis.cluster.RedisCluster.from_url(
        redis_cluster.url.replace("redis+cluster", "redis"), password=redis_cluster.password)
    assert c.exists(red.rkey(ns.key(4))) == 1
    c.close()
    st.close()


def test_full_coverage_cluster_down_fails_soft(ns, layout, make_blocks):
    """With Redis's default `cluster-require-full-coverage yes`, once a dead master is
    marked failed the survivors refuse every key (CLUSTERDOWN): all misses, errors
    counted, nothing raised; the README says to run a cache cluster with `no`."""
    from kvyard.kvstore.redis_server import RedisClusterServers

    with RedisClusterServers(password="full-cov", full_coverage=True) as rc:
        red, st, hashes, _, _ = _filled(rc, ns, make_blocks)
        assert sum(b is not None for b in st.get(hashes)) == N
        rc.kill(0)
        rc.wait_state(lambda info: info.get("cluster_state") == "fail",
                      time.monotonic() + 30, "cluster_state:fail on the survivors")
        got = st.get(hashes)
        assert got == [None] * N
        assert st.lookup(hashes) == (0, [])
        st.put([N + 1], make_blocks(1))
        assert st.flush()
        assert red.stats.errors >= 2 and red.stats.hits == N
        st.close()
