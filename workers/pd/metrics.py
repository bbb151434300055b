"""The decode worker's P/D metrics (names in kvyard.common.wire) and the role info metric."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvyard.common import wire

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FALLBACK_REASONS = ("prefill_unreachable", "prefill_timeout", "prefill_error", "kv_mismatch",
                    "transfer_failed", "transfer_truncated", "transfer_corrupt",
                    "transfer_timeout", "transfer_refused", "unsupported_request")
PATHS = ("peer", "store")


def worker_info(registry: CollectorRegistry, role: str) -> None:
    """`kvyard:worker_info{role="..."} 1`, vLLM's *_info style."""
    g = Gauge(wire.M_WORKER_INFO, "This worker's static facts.", ["role"], registry=registry)
    g.labels(role=role).set(1)


class PDMetrics:
    """All on the live registry (rendered on every scrape): the histogram has two
    series, so it costs a scrape little, and its count then always matches the
    counters beside it."""

    def __init__(self, registry: CollectorRegistry, slow_registry: CollectorRegistry) -> None:
        self.handoffs = Counter(wire.M_PD_HANDOFFS.removesuffix("_total"),
                                "P/D prefills whose KV this worker loaded, by path.",
                                ["path"], registry=registry)
        self.fallbacks = Counter(wire.M_PD_FALLBACKS.removesuffix("_total"),
                                 "P/D requests this worker prefilled itself instead, by reason.",
                                 ["reason"], registry=registry)
        self.bytes = Counter(wire.M_PD_HANDOFF_BYTES.removesuffix("_total"),
                             "KV bytes received in P/D handoffs.", registry=registry)
        self.rejected = Counter(wire.M_PD_REJECTED.removesuffix("_total"),
                                "Prefill targets refused (unsigned, expired, bad signature).",
                                registry=registry)
        self.seconds = Histogram(wire.M_PD_HANDOFF_SECONDS,
                                 "Time to receive a handoff's KV (the transfer, not the prefill).",
                                 ["path"], buckets=_SECONDS, registry=registry)
        for p in PATHS:
            self.handoffs.labels(path=p)
        for r in FALLBACK_REASONS:
            self.fallbacks.labels(reason=r)
