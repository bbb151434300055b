"""Framed puts and the copy-free read path (`get_into`) through every tier."""
from __future__ import annotations

import numpy as np
import redis

from kvyard.kvstore import KVStore
from kvyard.kvstore.codec import HEADER_BYTES, decode
from kvyard.kvstore.dram import DramTier
from kvyard.kvstore.redis_tier import RedisTier
from kvyard.kvstore.ssd import SsdTier


def _framed(blocks: list[bytes]) -> np.ndarray:
    f = np.zeros((len(blocks), HEADER_BYTES + len(blocks[0])), dtype=np.uint8)
    for i, b in enumerate(blocks):
        f[i, HEADER_BYTES:] = np.frombuffer(b, dtype=np.uint8)
    return f


def test_framed_put_reaches_every_tier_with_a_valid_header(ns, layout, make_blocks,
                                                           tmp_path, redis_server):
    red = RedisTier(redis_server.url, password=redis_server.password, timeout_s=0.5)
    st = KVStore(ns, dram=DramTier(1 << 20), ssd=SsdTier(tmp_path, 1 << 20), redis=red)
    blocks = make_blocks(3)
    assert st.put([1, 2, 3], list(_framed(blocks))) == 3
    assert st.flush()
    raw = redis.Redis(port=redis_server.port, password=redis_server.password)
    for h, b in zip([1, 2, 3], blocks):
        assert bytes(decode(raw.get(red.rkey(ns.key(h))), ns.key(h), layout)) == b
        assert bytes(decode(open(st.ssd.path(ns.key(h)), "rb").read(), ns.key(h), layout)) == b
        assert bytes(st.dram.get(ns.key(h))) == b
    raw.close()
    st.close()


def test_get_into_fills_a_prefix_from_each_tier(ns, layout, make_blocks, tmp_path,
                                                redis_server):
    red = RedisTier(redis_server.url, password=redis_server.password, timeout_s=0.5)
    writer = KVStore(ns, ssd=SsdTier(tmp_path / "w", 1 << 20), redis=red)
    blocks = make_blocks(4)
    writer.put([1, 2, 3, 4], blocks)
    assert writer.flush()
    # reader: block 1 in DRAM, block 2 on its SSD, blocks 3-4 only in Redis
    reader = KVStore(ns, dram=DramTier(1 << 20), ssd=SsdTier(tmp_path / "r", 1 << 20),
                     redis=RedisTier(redis_server.url, password=redis_server.password))
    reader.dram.put(ns.key(1), blocks[0])
    with open(writer.ssd.path(ns.key(2)), "rb") as f:
        reader.ssd.put(ns.key(2), [f.read()])
    outs = np.zeros((5, layout.nbytes), dtype=np.uint8)
    assert reader.get_into([1, 2, 3, 4, 5], list(outs)) == 4
    assert [outs[i].tobytes() for i in range(4)] == blocks
    assert not outs[4].any()
    s = reader.stats()
    assert (s["dram"]["hits"], s["ssd"]["hits"], s["redis"]["hits"]) == (1, 1, 2)
    assert reader.flush()
    assert reader.lookup([1, 2, 3, 4]) == (4, ["dram"] * 4)  # every hit was promoted
    assert reader.ssd.contains(ns.key(3))                    # and Redis hits reached SSD
    writer.close()
    reader.close()


def test_get_into_stops_at_a_corrupt_ssd_block(ns, layout, make_blocks, tmp_path):
    st = KVStore(ns, ssd=SsdTier(tmp_path, 1 << 20))
    st.put([1, 2, 3], make_blocks(3))
    assert st.flush()
    with open(st.ssd.path(ns.key(2)), "r+b") as f:
        f.seek(HEADER_BYTES + 3)
        f.write(b"\x00\x01\x02")
    outs = np.zeros((3, layout.nbytes), dtype=np.uint8)
    assert st.get_into([1, 2, 3], list(outs)) == 1
    assert st.stats()["ssd"]["errors"] == 1 and not st.ssd.contains(ns.key(2))
    st.close()
