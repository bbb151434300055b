"""The P/D metrics (names in kvyard.common.wire): the decode worker's handoffs, the
prefill worker's holds, and the role info metric."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvyard.common import wire

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FALLBACK_REASONS = ("prefill_unreachable", "prefill_timeout", "prefill_error", "kv_mismatch",
                    "transfer_failed", "transfer_truncated", "transfer_corrupt",
                    "transfer_timeout", "transfer_refused", "unsupported_request",
                    "no_transport", "prefill_failed")
PATHS = ("peer", "store")
TRANSPORTS = ("shm", "tcp")
# where a handoff's time goes: the prefill leg's HTTP round trip, the pull's claim (connect
# to the ok), transfer (to the last byte; or the store's read), verify (checksums after
# it), the engine's insert; a streamed pull's tail (from learning that the prefill ended
# to its last block verified: what the stream leaves on the critical path)
PHASES = ("prefill_leg", "claim", "transfer", "verify", "insert", "stream_tail")
STREAMED = ("during_prefill", "after_prefill")
HOLD_OUTCOMES = ("pulled", "expired", "aborted")


def worker_info(registry: CollectorRegistry, role: str) -> None:
    """`kvyard:worker_info{role="..."} 1`, vLLM's *_info style."""
    g = Gauge(wire.M_WORKER_INFO, "This worker's static facts.", ["role"], registry=registry)
    g.labels(role=role).set(1)


class PDMetrics:
    """All on the live registry (rendered on every scrape): the histogram has two
    series, so it costs a scrape little, and its count then always matches the
    counters beside it."""

    def __init__(self, registry: CollectorRegistry, slow_registry: CollectorRegistry) -> None:
        self.registry = registry  # the prefill side's HoldCollector joins it (runtime.py)
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
                                 "Time to receive a handoff's KV (the transfer, not the "
                                 "prefill; streamed: what is left after the prefill ends).",
                                 ["path"], buckets=_SECONDS, registry=registry)
        self.transfers = Counter(wire.M_PD_TRANSFERS.removesuffix("_total"),
                                 "Peer handoffs by transport: a same-host memfd or TCP.",
                                 ["transport"], registry=registry)
        # live too: its counts agree with the handoff counters in any one scrape
        self.phases = Histogram(wire.M_PD_PHASE_SECONDS,
                                "Where a handoff's time goes, by phase.", ["phase"],
                                buckets=_SECONDS, registry=registry)
        self.streamed = Counter(wire.M_PD_STREAMED_BLOCKS.removesuffix("_total"),
                                "Blocks of streamed handoffs, by when the prefill worker sent "
                                "them: while it still computed the prompt, or after.",
                                ["when"], registry=registry)
        for w in STREAMED:
            self.streamed.labels(when=w)
        for p in PATHS:
            self.handoffs.labels(path=p)
        for r in FALLBACK_REASONS:
            self.fallbacks.labels(reason=r)
        for t in TRANSPORTS:
            self.transfers.labels(transport=t)
        for ph in PHASES:
            self.phases.labels(phase=ph)


class HoldCollector:
    """The prefill worker's holds, read at scrape time: blocks held now, and holds ended
    by outcome (pulled in full; expired unpulled; aborted: claimed, the transfer cut
    short). `counts` returns (held blocks, {outcome: total})."""

    def __init__(self, counts: Callable[[], tuple[int, dict[str, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Any]:
        held, ended = self._counts()
        g = GaugeMetricFamily(wire.M_PD_HELD_BLOCKS, "KV blocks held for decode pulls now.")
        g.add_metric([], held)
        yield g
        c = CounterMetricFamily(wire.M_PD_HOLDS.removesuffix("_total"),
                                "P/D holds ended, by outcome.", labels=["outcome"])
        for o in HOLD_OUTCOMES:
            c.add_metric([o], ended.get(o, 0))
        yield c

    def describe(self) -> Iterator[Any]:
        return iter(())
