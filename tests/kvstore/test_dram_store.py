"""DRAM tier and the store's write/read paths without external services."""
from __future__ import annotations

import asyncio

from kvyard.kvstore import KVStore
from kvyard.kvstore.dram import DramTier
from kvyard.kvstore.ssd import SsdTier


def test_dram_put_get_lookup_and_lru_eviction(ns, layout, make_blocks):
    st = KVStore(ns, dram=DramTier(3 * layout.nbytes))
    blocks = make_blocks(4)
    assert st.put([1, 2, 3], blocks[:3]) == 3
    assert st.lookup([1, 2, 3, 4]) == (3, ["dram"] * 3)
    assert bytes(st.get([1])[0]) == blocks[0]  # 1 is now most recent; 2 is the LRU
    st.put([4], blocks[3:])
    assert st.lookup([2]) == (0, [])
    assert [bytes(b) for b in st.get([1, 3, 4])] == [blocks[0], blocks[2], blocks[3]]
    s = st.stats()["dram"]
    assert s["evictions"] == 1 and s["bytes"] == 3 * layout.nbytes and s["hits"] == 4
    assert st.get([99]) == [None] and st.stats()["dram"]["misses"] == 1


def test_lookup_is_a_contiguous_prefix(ns, layout, make_blocks):
    st = KVStore(ns, dram=DramTier(10 * layout.nbytes))
    st.put([1, 2, 4], make_blocks(3))
    assert st.lookup([1, 2, 3, 4]) == (2, ["dram", "dram"])
    assert st.lookup([3, 1]) == (0, [])


def test_ssd_hit_is_promoted_into_dram(ns, layout, make_blocks, tmp_path):
    dram = DramTier(10 * layout.nbytes)
    st = KVStore(ns, dram=dram, ssd=SsdTier(tmp_path, 10 * (layout.nbytes + 80)))
    blocks = make_blocks(2)
    st.put([1, 2], blocks)
    assert st.flush()
    dram.discard(ns.key(1))
    assert st.lookup([1, 2]) == (2, ["ssd", "dram"])
    assert bytes(st.get([1])[0]) == blocks[0]
    assert st.stats()["ssd"]["hits"] == 1
    assert st.lookup([1, 2]) == (2, ["dram", "dram"])
    st.close()


def test_back_pressure_drops_writes_instead_of_blocking(ns, layout, make_blocks, tmp_path):
    ssd = SsdTier(tmp_path, 100 * (layout.nbytes + 80))
    st = KVStore(ns, dram=DramTier(100 * layout.nbytes), ssd=ssd, queue_blocks=4)
    blocks = make_blocks(20)
    with ssd._lock:  # the writer stalls on its first block: a disk that hangs
        accepted = st.put(list(range(20)), blocks)
        # would deadlock here if put waited for the writer
        assert st.dropped_writes == 20 - accepted
        assert 4 <= accepted <= 5  # the queue, plus at most the one the writer holds
        assert st.lookup(list(range(20)))[0] == 20  # DRAM still took every block
    assert st.flush()
    on_disk = [i for i in range(20) if ssd.contains(ns.key(i))]
    assert len(on_disk) == accepted
    st.close()


async def test_async_api(ns, layout, make_blocks, tmp_path):
    st = KVStore(ns, dram=DramTier(10 * layout.nbytes), ssd=SsdTier(tmp_path, 1 << 20))
    blocks = make_blocks(2)
    assert await st.aput([5, 6], blocks) == 2
    assert await st.aflush()
    assert await st.alookup([5, 6]) == (2, ["dram", "dram"])
    got = await asyncio.gather(st.aget([5]), st.aget([6]))
    assert [bytes(g[0]) for g in got] == blocks
    st.close()
