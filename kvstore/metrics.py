"""Prometheus export of the store's counters, as a Collector the worker registers.

A custom Collector (rather than Counter objects updated on the hot path) reads
the tiers' plain-int stats only when scraped, so the store pays nothing per
operation for metrics, and several stores can be registered side by side.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvyard.kvstore.store import KVStore

TIER_UP = "kvyard:kvstore_tier_up"
ERRORS = "kvyard:kvstore_errors_total"
_COUNTERS = (
    ("hits", "kvyard:kvstore_hits_total", "Blocks served by this tier"),
    ("misses", "kvyard:kvstore_misses_total", "Block reads this tier could not serve"),
    ("evictions", "kvyard:kvstore_evictions_total", "Blocks evicted from this tier"),
    ("errors", ERRORS,
     "Failed operations or corrupt blocks detected in this tier"),
)


class KVStoreCollector(Collector):
    """`store` may be a KVStore or a zero-argument callable returning one (or None
    while it does not exist yet: the connector creates its store when the engine
    binds its KV cache, after the server has built its registry)."""

    def __init__(self, store: KVStore | Callable[[], KVStore | None]) -> None:
        self._store = store

    def collect(self):
        store = self._store if isinstance(self._store, KVStore) else self._store()
        if store is None:
            return
        stats = store.stats()
        for field, name, doc in _COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, s in stats.items():
                fam.add_metric([tier], s[field])
            yield fam
        g = GaugeMetricFamily("kvyard:kvstore_bytes", "Bytes held by this tier", labels=["tier"])
        for tier, s in stats.items():
            g.add_metric([tier], s["bytes"])
        yield g
        up = GaugeMetricFamily(TIER_UP, "1 while this tier is served, 0 while it is skipped "
                               "after a failure (Redis unreachable)", labels=["tier"])
        for tier, t in store.tiers.items():
            up.add_metric([tier], 1.0 if getattr(t, "available", True) else 0.0)
        yield up
        yield CounterMetricFamily("kvyard:kvstore_dropped_writes_total",
                                  "Block writes dropped because the writer queue was full",
                                  value=store.dropped_writes)
