"""Blocks of another model or another layout never hit, in any tier, even for equal hashes."""
from __future__ import annotations

import pytest

from kvyard.kvstore import KVLayout, KVStore, Namespace
from kvyard.kvstore.dram import DramTier
from kvyard.kvstore.redis_tier import RedisTier
from kvyard.kvstore.ssd import SsdTier


def _store(ns, tmp_path, rs):
    return KVStore(ns, dram=DramTier(1 << 20), ssd=SsdTier(tmp_path, 1 << 22),
                   redis=RedisTier(rs.url, password=rs.password, timeout_s=0.5))


@pytest.mark.parametrize("other", ["model", "fingerprint", "dtype", "block_size", "heads"])
def test_other_namespace_never_hits(ns, layout, make_blocks, tmp_path, redis_server, other):
    lay = layout
    if other == "model":
        ns2 = Namespace("model-b@0123456789abcdef", lay)
    elif other == "fingerprint":
        ns2 = Namespace("model-a@fedcba9876543210", lay)
    else:
        change = {"dtype": {"dtype": "float16"}, "block_size": {"block_size": 8},
                  "heads": {"num_kv_heads": 4, "head_dim": 4}}[other]
        fields = dict(dtype=lay.dtype, block_size=lay.block_size, num_layers=lay.num_layers,
                      num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim) | change
        ns2 = Namespace(ns.model, KVLayout(**fields))
    a = _store(ns, tmp_path, redis_server)
    a.put([1, 2, 3], make_blocks(3))
    assert a.flush()
    assert a.lookup([1, 2, 3])[0] == 3
    b = _store(ns2, tmp_path, redis_server)  # same SSD directory, same Redis, same hashes
    assert b.lookup([1, 2, 3]) == (0, [])
    assert b.get([1, 2, 3]) == [None, None, None]
    assert b.stats()["redis"]["hits"] == 0 and b.stats()["ssd"]["hits"] == 0
    a.close()
    b.close()
