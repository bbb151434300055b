"""The Prometheus collector exports the store's counters under the agreed names."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvyard.kvstore import KVStore
from kvyard.kvstore.dram import DramTier
from kvyard.kvstore.metrics import KVStoreCollector
from kvyard.kvstore.ssd import SsdTier


def test_collector_exports_per_tier_series(ns, layout, make_blocks, tmp_path):
    st = KVStore(ns, dram=DramTier(2 * layout.nbytes), ssd=SsdTier(tmp_path, 1 << 20))
    st.put([1, 2, 3], make_blocks(3))
    assert st.flush()
    st.get([3, 7])
    reg = CollectorRegistry()
    reg.register(KVStoreCollector(st))
    text = generate_latest(reg).decode()
    assert 'kvyard:kvstore_hits_total{tier="dram"} 1.0' in text
    assert 'kvyard:kvstore_misses_total{tier="ssd"} 1.0' in text
    assert 'kvyard:kvstore_evictions_total{tier="dram"} 1.0' in text
    assert f'kvyard:kvstore_bytes{{tier="dram"}} {float(2 * layout.nbytes)}' in text
    assert 'kvyard:kvstore_errors_total{tier="ssd"} 0.0' in text
    assert "kvyard:kvstore_dropped_writes_total 0.0" in text
    assert 'kvyard:kvstore_tier_up{tier="dram"} 1.0' in text
    assert 'kvyard:kvstore_tier_up{tier="ssd"} 1.0' in text
    lazy = CollectorRegistry()
    holder: dict = {}
    lazy.register(KVStoreCollector(lambda: holder.get("s")))
    assert "kvstore_hits" not in generate_latest(lazy).decode()
    holder["s"] = st
    assert 'kvyard:kvstore_hits_total{tier="dram"}' in generate_latest(lazy).decode()
    st.close()
