"""The connector with KV caches on a CUDA device: blocks go through pinned host
memory (frames carved from the connector's PinnedArena on save, two reused
staging buffers on load) and come back byte-identical, through DRAM alone and
through DRAM + SSD. Skipped without a GPU (CI has none); run on a GPU machine:
`pytest tests/kvstore/test_connector_cuda.py`."""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch

from kvyard.kvstore import StoreConfig
from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.workers import kvconnector
from kvyard.workers.kvconnector import StoreConnector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BS, LAYERS, HEADS, DIM = 16, 4, 2, 64


def _caches(dtype, blocks=64, fill=True, device="cuda"):
    shape = (2, blocks, BS, HEADS, DIM)
    if fill:
        return [torch.randn(*shape, device=device).to(dtype) for _ in range(LAYERS)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(LAYERS)]


def _pinned(buf) -> bool:
    """Is this host buffer (a store's read-only view) in page-locked memory?"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about read-only numpy arrays
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8)).is_pinned()


@pytest.fixture(params=["one-slab", "small-slabs"])
def slabs(request, monkeypatch):
    """The default 32 MiB slabs, and slabs of 3 frames so every call spans several
    (several D2H runs per save, double-buffered H2D with events on load)."""
    if request.param == "small-slabs":
        nb = LAYERS * 2 * BS * HEADS * DIM * 4
        monkeypatch.setattr(kvconnector.staging, "_SLAB_BYTES", 3 * (nb + HEADER_BYTES) + 100)
        monkeypatch.setattr(kvconnector.staging, "_GATHER_BYTES", 2 * (nb + HEADER_BYTES))  # gathers of 2
    return request.param


def _check(src, dst, src_ids, dst_ids):
    torch.cuda.synchronize()
    untouched = sorted(set(range(dst[0].shape[1])) - set(dst_ids))
    for s, d in zip(src, dst):
        # byte-identical: compare the raw bits, not values (NaN-safe, -0.0 vs 0.0)
        assert torch.equal(s[:, src_ids].view(torch.uint8), d[:, dst_ids].view(torch.uint8))
        assert not d[:, untouched].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_round_trip_through_dram(slabs, dtype):
    cfg = StoreConfig(dram_bytes=1 << 30)
    src = _caches(dtype)
    a = StoreConnector(cfg, "m@1")
    a.bind(src, BS)
    assert a._staged and a._arena.pin
    hashes = list(range(1000, 1020))
    src_ids = [5, 3, 9, 0, 63, 17, 18, 19, 40, 41, 2, 1, 7, 8, 11, 12, 13, 14, 30, 31]
    a.save(hashes[:6], src_ids[:6])
    a.save(hashes, src_ids)
    assert a.saved_blocks == 20 and a._arena.pinned_fallbacks == 0
    for h in hashes:  # the frames the DRAM tier holds are page-locked
        assert _pinned(a.store.dram.get(a.store.namespace.key(h)))
    dst = _caches(dtype, fill=False)
    b = StoreConnector(cfg, "m@1", store=a.store)  # same process: one DRAM tier
    b.bind(dst, BS)
    assert all(t.is_pinned() for t, _ in b._load_host)
    assert b.lookup(hashes + [1]) == 20
    dst_ids = list(range(40, 60))
    assert b.load(hashes + [1], dst_ids + [60]) == 20
    _check(src, dst, src_ids, dst_ids)
    a.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_round_trip_through_dram_and_ssd(tmp_path, slabs, dtype):
    cfg = StoreConfig(dram_bytes=1 << 30, ssd_dir=str(tmp_path), ssd_bytes=1 << 30)
    src = _caches(dtype)
    a = StoreConnector(cfg, "m@1")
    a.bind(src, BS)
    hashes, src_ids = list(range(1, 13)), [4, 8, 15, 16, 23, 42, 0, 1, 2, 3, 62, 63]
    a.save(hashes, src_ids)
    assert a.store.flush()
    dst = _caches(dtype, fill=False)
    b = StoreConnector(cfg, "m@1")  # another store: only the directory is shared
    b.bind(dst, BS)
    assert b.load(hashes, list(range(20, 32))) == 12
    assert b.store.stats()["ssd"]["hits"] == 12
    assert b.load(hashes[:5], list(range(50, 55))) == 5  # promoted: DRAM hits now
    assert b.store.stats()["dram"]["hits"] == 5
    _check(src, dst, src_ids + src_ids[:5], list(range(20, 32)) + list(range(50, 55)))
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_own_dram_hits_load_in_place(tmp_path, slabs, dtype):
    """A connector loading its own saves: the DRAM hits' pinned frames go to the GPU
    where they lie (no staging copy); after the head left DRAM, the head comes
    through staging from SSD and the rest in place again; bytes identical."""
    cfg = StoreConfig(dram_bytes=1 << 30, ssd_dir=str(tmp_path), ssd_bytes=1 << 30)
    src = _caches(dtype)
    a = StoreConnector(cfg, "m@1")
    a.bind(src, BS)
    hashes, src_ids = list(range(500, 516)), [9, 8, 7, 6, 5, 4, 3, 2, 33, 34, 35, 36, 50, 51, 52, 1]
    a.save(hashes[:5], src_ids[:5])
    a.save(hashes[5:], src_ids[5:])
    assert a.store.flush()
    dst = _caches(dtype, fill=False)
    a._caches = dst  # same connector, same arena, a fresh cache
    assert a.load(hashes, list(range(16))) == 16 and a.direct_blocks == 16
    _check(src, dst, src_ids, list(range(16)))
    for k in a.store.namespace.keys(hashes[:3]):
        a.store.dram.discard(k)
    before = a.store.stats()["ssd"]["hits"]
    assert a.load(hashes, list(range(20, 36))) == 16 and a.direct_blocks == 16 + 13
    assert a.store.stats()["ssd"]["hits"] - before == 3
    _check(src, dst, src_ids + src_ids, list(range(16)) + list(range(20, 36)))
    a.close()


def test_cuda_frames_survive_eviction_churn(monkeypatch):
    """A small DRAM tier evicting while saves keep coming: arena slabs (3 frames
    each here) are reused, and what the tier still holds is never overwritten."""
    nb = LAYERS * 2 * BS * HEADS * DIM * 2
    monkeypatch.setattr(kvconnector.staging, "_SLAB_BYTES", 3 * (nb + HEADER_BYTES) + 100)
    cfg = StoreConfig(dram_bytes=24 * nb)
    src = _caches(torch.bfloat16)
    a = StoreConnector(cfg, "m@1")
    a.bind(src, BS)
    for r in range(30):
        a.save([10_000 + r * 8 + i for i in range(8)], [(r * 8 + i) % 64 for i in range(8)])
    gc.collect()
    # 240 frames saved, 24 held: ~8 slabs live, a few more in the churn, not 80
    assert a._arena.nbytes <= 16 * kvconnector._SLAB_BYTES
    last = [10_000 + 29 * 8 + i for i in range(8)]
    dst = _caches(torch.bfloat16, fill=False)
    b = StoreConnector(cfg, "m@1", store=a.store)
    b.bind(dst, BS)
    assert b.load(last, list(range(8))) == 8
    _check(src, dst, [(29 * 8 + i) % 64 for i in range(8)], list(range(8)))


def test_cuda_pageable_baseline_and_cpu_cache_still_work():
    cfg = StoreConfig(dram_bytes=1 << 28)
    src = _caches(torch.bfloat16)
    a = StoreConnector(cfg, "m@1", pin_memory=False)  # the benchmark's baseline
    a.bind(src, BS)
    assert a._staged and not a._arena.pin and not a._load_host[0][0].is_pinned()
    a.save([1, 2, 3], [7, 8, 9])
    assert not _pinned(a.store.dram.get(a.store.namespace.key(1)))
    dst = _caches(torch.bfloat16, fill=False)
    b = StoreConnector(cfg, "m@1", store=a.store, pin_memory=False)
    b.bind(dst, BS)
    assert b.load([1, 2, 3], [0, 1, 2]) == 3
    _check(src, dst, [7, 8, 9], [0, 1, 2])
    # CPU caches on a GPU machine: the plain path, no staging
    cpu_src = _caches(torch.bfloat16, device="cpu")
    c = StoreConnector(cfg, "m@2")
    c.bind(cpu_src, BS)
    assert not c._staged and c._arena is None
    c.save([1, 2], [3, 4])
    cpu_dst = _caches(torch.bfloat16, fill=False, device="cpu")
    d = StoreConnector(cfg, "m@2", store=c.store)
    d.bind(cpu_dst, BS)
    assert d.load([1, 2], [0, 1]) == 2
    for s, t in zip(cpu_src, cpu_dst):
        assert torch.equal(s[:, [3, 4]], t[:, [0, 1]])
