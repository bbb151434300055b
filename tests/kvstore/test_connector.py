"""The engine-side connector: bytes in and out of real KV-cache tensors, and the
engine producing identical greedy tokens whether prefix blocks are computed or
loaded from each tier."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from kvyard.kvstore import KVLayout, StoreConfig
from kvyard.workers.kvconnector import (StoreConnector, add_kv_arguments, build_connector,
                                        store_config)


def _caches(dtype, layers=3, blocks=12, bs=4, heads=2, dim=8, fill=True):
    make = (lambda: torch.randn(2, blocks, bs, heads, dim).to(dtype)) if fill else \
        (lambda: torch.zeros(2, blocks, bs, heads, dim, dtype=dtype))
    return [make() for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_save_then_load_through_ssd_copies_exact_blocks(tmp_path, dtype):
    cfg = StoreConfig(ssd_dir=str(tmp_path), ssd_bytes=1 << 24)
    src = _caches(dtype)
    a = StoreConnector(cfg, "m@1")
    a.bind(src, 4)
    a.save([101, 102, 103], [3, 7, 0])
    assert a.store.flush()
    dst = _caches(dtype, fill=False)
    b = StoreConnector(cfg, "m@1")  # a second store: only the directory is shared
    b.bind(dst, 4)
    assert b.lookup([101, 102, 103, 104]) == 3
    assert b.load([101, 102, 103], [5, 6, 11]) == 3
    for s, d in zip(src, dst):
        assert torch.equal(s[:, [3, 7, 0]], d[:, [5, 6, 11]])
        assert not d[:, [0, 1, 2, 3, 4, 7, 8, 9, 10]].any()  # nothing else written
    assert b.store.stats()["ssd"]["hits"] == 3
    a.close()
    b.close()


def test_corrupt_block_stops_the_load_there(tmp_path):
    cfg = StoreConfig(ssd_dir=str(tmp_path), ssd_bytes=1 << 24)
    src = _caches(torch.bfloat16)
    a = StoreConnector(cfg, "m@1")
    a.bind(src, 4)
    a.save([1, 2, 3], [0, 1, 2])
    assert a.store.flush()
    path = a.store.ssd.path(a.store.namespace.key(2))
    with open(path, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff" * 10)
    dst = _caches(torch.bfloat16, fill=False)
    b = StoreConnector(cfg, "m@1")
    b.bind(dst, 4)
    assert b.load([1, 2, 3], [4, 5, 6]) == 1  # block 2 (and so 3) are recomputed
    assert torch.equal(dst[0][:, 4], src[0][:, 0]) and not dst[0][:, 5:7].any()
    assert b.store.stats()["ssd"]["errors"] == 1 and not os.path.exists(path)


def test_bind_checks_layout_and_other_models_miss(tmp_path):
    cfg = StoreConfig(dram_bytes=1 << 20, ssd_dir=str(tmp_path), ssd_bytes=1 << 24)
    c = StoreConnector(cfg, "m@1", KVLayout("float32", 4, 3, 2, 8))
    with pytest.raises(ValueError):
        c.bind(_caches(torch.bfloat16), 4)
    c.bind(_caches(torch.float32), 4)
    c.save([1], [0])
    assert c.store.flush()
    other = StoreConnector(cfg, "m@2")
    other.bind(_caches(torch.float32), 4)
    assert other.lookup([1]) == 0
    c.close()
    other.close()


def test_flags_and_build_connector(tmp_path, monkeypatch):
    p = argparse.ArgumentParser()
    add_kv_arguments(p)
    assert build_connector(p.parse_args([]), "m@1") is None
    monkeypatch.setenv("KVYARD_REDIS_PASSWORD", "from-env")
    args = p.parse_args(["--kv-dram-gb", "0.5", "--kv-ssd-dir", str(tmp_path), "--kv-ssd-gb",
                         "2", "--kv-redis-url", "redis://h:1/0", "--kv-redis-ttl", "60",
                         "--kv-redis-prefix", "x:"])
    cfg = store_config(args)
    assert (cfg.dram_bytes, cfg.ssd_bytes, cfg.redis_ttl_s, cfg.redis_prefix) == \
        (500_000_000, 2_000_000_000, 60, "x:")
    assert cfg.redis_password == "from-env"
    args = p.parse_args(["--kv-redis-url", "redis://h:1/0", "--kv-redis-password", "flag"])
    assert store_config(args).redis_password == "flag"
    with pytest.raises(ValueError):
        store_config(p.parse_args(["--kv-ssd-dir", str(tmp_path)]))
    assert isinstance(build_connector(args, "m@1"), StoreConnector)
