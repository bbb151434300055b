"""Redis going away is visible: one warning per store naming the tier and the error,
one info line when it is back, whatever the number of operations in between; and
the `kvyard:kvstore_tier_up` gauge says 0 while it is down."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest

from kvyard.kvstore import KVStore
from kvyard.kvstore.dram import DramTier
from kvyard.kvstore.metrics import KVStoreCollector
from kvyard.kvstore.redis_server import RedisServer, free_port
from kvyard.kvstore.redis_tier import RedisTier


def _lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvyard.kvstore" and r.levelno == level]


def _up(store: KVStore) -> str:
    reg = CollectorRegistry()
    reg.register(KVStoreCollector(store))
    text = generate_latest(reg).decode()
    return next(ln for ln in text.splitlines()
                if ln.startswith('kvyard:kvstore_tier_up{tier="redis"}')).split()[-1]


def test_redis_loss_and_return_are_logged_once(ns, make_blocks, wait_until, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvyard.kvstore")
    port, pw = free_port(), "faults-pw"
    red = RedisTier(f"redis://127.0.0.1:{port}/0", password=pw, timeout_s=0.2,
                    backoff_s=(0.02, 0.1))
    st = KVStore(ns, dram=DramTier(1 << 20), redis=red)
    blocks = make_blocks(4)
    h = iter(range(1, 1_000_000))

    def work() -> None:  # a put, a lookup and a read, as a worker does per request
        k = next(h)
        st.put([k], [blocks[k % 4]])
        st.flush()
        st.lookup([k, 10**7])
        st.get([10**7])

    with RedisServer(port=port, password=pw):
        for _ in range(20):
            work()
        assert red.available and _up(st) == "1.0"
    # gone: many operations, several failed trials, one warning
    wait_until(lambda: (work(), red.breaker.failures >= 4)[1], timeout=20,
               what="several failed trials against the dead redis")
    for _ in range(50):
        work()
    assert not red.available and _up(st) == "0.0"
    down = _lines(caplog, logging.WARNING)
    assert len(down) == 1, down
    assert f"redis (127.0.0.1:{port})" in down[0] and "ConnectionError" in down[0]
    assert pw not in down[0]
    assert _lines(caplog, logging.INFO) == []
    with RedisServer(port=port, password=pw):
        wait_until(lambda: (work(), red.available)[1], timeout=20, what="redis back")
        for _ in range(50):
            work()
        assert _up(st) == "1.0"
    back = _lines(caplog, logging.INFO)
    assert len(back) == 1 and f"redis (127.0.0.1:{port}) is back" in back[0], back
    assert len(_lines(caplog, logging.WARNING)) == 1
    assert red.stats.errors >= 4
    st.close()
