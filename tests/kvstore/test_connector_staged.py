"""The connector's staged path (what CUDA caches use: gather into frames carved
from a `PinnedArena`, load through two reused staging buffers), run here with
CPU caches and pageable slabs so CI, which has no GPU, covers its logic: runs
split across slabs, double-buffered loads, slab recycling only once the store
lets go. tests/kvstore/test_connector_cuda.py runs it on a real device."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kvyard.kvstore import StoreConfig
from kvyard.kvstore.codec import HEADER_BYTES
from kvyard.workers import kvconnector
from kvyard.workers.kvconnector import PinnedArena, StoreConnector

BS, LAYERS, HEADS, DIM = 4, 3, 2, 8


def _caches(dtype, blocks=40, fill=True):
    shape = (2, blocks, BS, HEADS, DIM)
    return [torch.randn(*shape).to(dtype) if fill else torch.zeros(shape, dtype=dtype)
            for _ in range(LAYERS)]


@pytest.fixture
def small_slabs(monkeypatch):
    """Slabs and load buffers of a few blocks, so every call spans several."""
    nb = LAYERS * 2 * BS * HEADS * DIM * 4  # float32, the larger of the two dtypes
    monkeypatch.setattr(kvconnector.staging, "_SLAB_BYTES", 3 * (nb + HEADER_BYTES) + 100)
    monkeypatch.setattr(kvconnector.staging, "_GATHER_BYTES", 2 * (nb + HEADER_BYTES))  # gathers of 2
    monkeypatch.setattr(StoreConnector, "_force_staging", True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_staged_round_trip_dram_then_ssd(tmp_path, small_slabs, dtype):
    cfg = StoreConfig(dram_bytes=1 << 24, ssd_dir=str(tmp_path), ssd_bytes=1 << 24)
    src = _caches(dtype)
    a = StoreConnector(cfg, "m@1", pin_memory=False)
    a.bind(src, BS)
    assert a._staged and not a._arena.pin
    hashes, ids = list(range(100, 117)), [3, 7, 0, 1, 9, 11, 12, 2, 30, 31, 4, 5, 6, 8, 10, 13, 39]
    a.save(hashes[:5], ids[:5])
    a.save(hashes, ids)  # the first five are already in DRAM: skipped
    assert a.saved_blocks == 17 and a.store.flush()
    # same process, shared DRAM tier
    dst = _caches(dtype, fill=False)
    b = StoreConnector(cfg, "m@1", store=a.store, pin_memory=False)
    b.bind(dst, BS)
    dst_ids = list(range(20, 37))
    assert b.load(hashes, dst_ids) == 17
    for s, d in zip(src, dst):
        assert torch.equal(s[:, ids], d[:, dst_ids])
        assert not d[:, :20].any() and not d[:, 37:].any()
    # a fresh store on the same directory: SSD hits, then DRAM hits after promotion
    c = StoreConnector(cfg, "m@1", pin_memory=False)
    dst2 = _caches(dtype, fill=False)
    c.bind(dst2, BS)
    assert c.load(hashes, dst_ids) == 17
    assert c.store.stats()["ssd"]["hits"] == 17
    assert c.load(hashes[:4], [0, 1, 2, 3]) == 4
    assert c.store.stats()["dram"]["hits"] == 4
    for s, d in zip(src, dst2):
        assert torch.equal(s[:, ids], d[:, dst_ids])
        assert torch.equal(s[:, ids[:4]], d[:, :4])
    a.close()
    c.close()


def test_staged_load_stops_at_first_missing_block(small_slabs):
    cfg = StoreConfig(dram_bytes=1 << 24)
    src = _caches(torch.float32)
    a = StoreConnector(cfg, "m@1", pin_memory=False)
    a.bind(src, BS)
    a.save(list(range(1, 8)) + list(range(9, 12)), list(range(7)) + [8, 9, 10])  # no hash 8
    dst = _caches(torch.float32, fill=False)
    b = StoreConnector(cfg, "m@1", store=a.store, pin_memory=False)
    b.bind(dst, BS)
    assert b.load(list(range(1, 12)), list(range(20, 31))) == 7
    assert torch.equal(dst[1][:, 20:27], src[1][:, :7]) and not dst[1][:, 27:].any()


def test_arena_reuses_a_slab_only_once_every_frame_is_gone():
    arena = PinnedArena(slab_bytes=4096, pin=False)
    t1, f1 = arena.carve(1000, 10)  # 4 frames fit in a slab
    assert f1.shape == (4, 1000) and t1.numel() == 4000 and arena.nbytes == 4096
    f1[2] = 5
    keep = memoryview(f1[2]).cast("B").toreadonly()  # what a DRAM tier holds
    del t1, f1
    t2, f2 = arena.carve(1000, 4)  # slab 0 is full (and referenced): a new slab
    assert arena.nbytes == 8192
    ptr2 = t2.data_ptr()
    del t2, f2
    t3, f3 = arena.carve(1000, 4)  # slab 1 is unreferenced: reused
    assert arena.nbytes == 8192 and t3.data_ptr() == ptr2
    f3[:] = 9
    t4, f4 = arena.carve(1000, 1)  # slab 0 still held through `keep`: never handed out
    assert arena.nbytes == 3 * 4096
    assert (np.frombuffer(keep, np.uint8) == 5).all()
    assert arena.live_slabs == 3
    del keep, t3, f3, t4, f4
    gc.collect()
    assert arena.live_slabs == 0
    for _ in range(6):  # churn with nothing held: the three slabs suffice
        t, f = arena.carve(1000, 4)
        f[:] = 1
        del t, f
    assert arena.nbytes == 3 * 4096


def test_arena_run_shares_a_slab_across_saves():
    arena = PinnedArena(slab_bytes=4096, pin=False)
    ta, fa = arena.carve(1000, 1)
    tb, fb = arena.carve(1000, 2)  # same slab, after the first run (512-byte aligned)
    assert tb.data_ptr() - ta.data_ptr() == 1024 and arena.nbytes == 4096
    tc, fc = arena.carve(1000, 5)  # one frame left in this slab (4096 - 3072)
    assert fc.shape == (1, 1000)


def test_cpu_caches_keep_the_plain_path():
    c = StoreConnector(StoreConfig(dram_bytes=1 << 20), "m@1")
    c.bind(_caches(torch.float32), BS)
    assert not c._staged and c._arena is None


def test_staged_frames_survive_eviction_churn(small_slabs):
    nb = LAYERS * 2 * BS * HEADS * DIM * 4
    cfg = StoreConfig(dram_bytes=24 * nb)
    src = _caches(torch.float32)
    a = StoreConnector(cfg, "m@1", pin_memory=False)
    a.bind(src, BS)
    for r in range(30):
        a.save([10_000 + r * 8 + i for i in range(8)], [(r * 8 + i) % 40 for i in range(8)])
    gc.collect()
    assert a._arena.nbytes <= 16 * kvconnector._SLAB_BYTES  # 80 slabs without reuse
    dst = _caches(torch.float32, fill=False)
    b = StoreConnector(cfg, "m@1", store=a.store, pin_memory=False)
    b.bind(dst, BS)
    assert b.load([10_000 + 29 * 8 + i for i in range(8)], list(range(8))) == 8
    for s, d in zip(src, dst):
        assert torch.equal(s[:, [(29 * 8 + i) % 40 for i in range(8)]], d[:, :8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_own_dram_hits_load_from_the_arena_in_place(tmp_path, small_slabs, dtype):
    """A connector's own saves sit in its arena: their DRAM hits are copied to the
    cache from there (runs of adjacent frames, across slabs), no staging copy; a
    block DRAM no longer holds comes through the staged path; every block is
    counted once."""
    nb = LAYERS * 2 * BS * HEADS * DIM * (2 if dtype == torch.bfloat16 else 4)
    cfg = StoreConfig(dram_bytes=12 * nb, ssd_dir=str(tmp_path), ssd_bytes=1 << 24)
    src = _caches(dtype)
    a = StoreConnector(cfg, "m@1", pin_memory=False)
    a.bind(src, BS)
    hashes, ids = list(range(200, 212)), [5, 1, 2, 3, 17, 18, 19, 20, 33, 34, 0, 9]
    a.save(hashes[:4], ids[:4])  # two saves: frames in more than one run
    a.save(hashes[4:], ids[4:])
    assert a.store.flush()
    for k in a.store.namespace.keys(hashes[:3]):  # the head leaves DRAM: on SSD only
        a.store.dram.discard(k)
    dst = _caches(dtype, fill=False)
    a._caches = dst  # the same connector (its arena) loading into a fresh cache
    before = a.store.stats()
    got = a.load(hashes[3:], list(range(21, 30)))
    assert got == 9 and a.direct_blocks == 9
    after = a.store.stats()
    assert after["dram"]["hits"] - before["dram"]["hits"] == 9
    assert after["dram"]["misses"] == before["dram"]["misses"]
    for s, d in zip(src, dst):
        assert torch.equal(s[:, ids[3:]], d[:, 21:30])
    # a prefix whose head left DRAM: the staged path reads it, in order, then the rest
    got = a.load(hashes, list(range(0, 12)))
    assert got == 12 and a.direct_blocks == 9 + 9
    assert a.store.stats()["ssd"]["hits"] - after["ssd"]["hits"] == 3
    for s, d in zip(src, dst):
        assert torch.equal(s[:, ids], d[:, :12])
    a.close()
