"""The vLLM metric names, so the EPP, GAIE and vLLM dashboards work unchanged.

Engine state (queues, KV usage, token and cache counters) is read from one
`EngineStats` snapshot at scrape time by a custom collector, so nothing is
mirrored or kept in sync; latency histograms are observed by the server, the
only place that sees request arrival and client-visible token times. Each app
owns its registry (no prometheus_client globals), so several servers can live
in one process, e.g. in tests.

The EPP scrapes every 50 ms but only routes on the engine gauges, so those
(and the few counters) are formatted fresh on every scrape, while the ~90
histogram samples (and extra collectors such as the kvstore's) are re-rendered
at most once per `SLOW_MAX_AGE_S`: formatting them dominated the cost of a
scrape (about 2.5 ms vs 0.3 ms), and dashboards read them every 15 s or so.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvyard.common import wire
from kvyard.workers.engine.api import EngineStats

# Buckets cover CPU-speed latencies (ms to minutes) with the resolution near the typical values.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
REQUEST_SUCCESS = "vllm:request_success_total"


class _EngineCollector:
    """Reads the engine's snapshot at scrape time; the names are vLLM's."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def describe(self) -> list[Metric]:
        return []  # unchecked registration: collect() calls the engine, never at register time

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        m = [self._model]
        lbl = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(m, value)
            return c

        yield gauge(wire.M_RUNNING, "Requests in the running batch.", s.num_running)
        yield gauge(wire.M_WAITING, "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge(wire.M_KV_USAGE, "KV-cache usage, 0..1.", s.kv_cache_usage)
        yield gauge(wire.M_PROMPT_TOKENS_PENDING,
                    "Prompt tokens admitted but not computed yet (queued, parked, mid-prefill).",
                    s.prompt_tokens_pending)
        info = GaugeMetricFamily(wire.M_CACHE_CONFIG, "KV-cache geometry.",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self._model, str(s.block_size), str(s.num_blocks)], 1.0)
        yield info
        yield counter(wire.M_PROMPT_TOKENS, "Prefilled prompt tokens.", s.prompt_tokens_total)
        yield counter(wire.M_GENERATION_TOKENS, "Generated tokens.",
                      s.generation_tokens_total)
        yield counter(wire.M_PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache.",
                      s.prefix_queries_tokens)
        yield counter(wire.M_PREFIX_HITS, "Prompt tokens found in the prefix cache.",
                      s.prefix_hits_tokens)
        yield counter("vllm:num_preemptions_total", "Preempted requests.", s.num_preemptions)
        if s.max_lora:  # vLLM's: an info gauge whose value is the time of the snapshot
            lora = GaugeMetricFamily(wire.M_LORA_INFO, "Running stats on lora requests.",
                                     labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
            lora.add_metric([",".join(s.running_lora_adapters), str(s.max_lora),
                             ",".join(s.waiting_lora_adapters)], time.time())
            yield lora
        if s.spec_decode is not None:
            yield from _spec_metrics(s.spec_decode, counter, self._model)


def _spec_metrics(sd: Any, counter: Callable[..., CounterMetricFamily], model: str) -> Iterator[Metric]:
    """vLLM's speculative decoding counters (engine/spec/stats.py)."""
    yield counter("vllm:spec_decode_num_drafts_total", "Drafts verified.", sd.num_drafts)
    yield counter("vllm:spec_decode_num_draft_tokens_total", "Draft tokens proposed.", sd.num_draft_tokens)
    yield counter("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
                  sd.num_accepted_tokens)
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafts whose token at this position was accepted.",
                                  labels=["model_name", "position"])
    for i, n in enumerate(sd.accepted_per_pos):
        per_pos.add_metric([model, str(i)], n)
    yield per_pos


@dataclass(slots=True)
class RequestClock:
    """Timestamps of one request as the client sees them."""

    metrics: "ServerMetrics"
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    done: bool = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
            n_gaps, since = n - 1, now
        else:
            n_gaps, since = n, self.last_token or now
        if n_gaps > 0:  # several tokens in one step share the gap evenly
            gap = (now - since) / n_gaps
            for _ in range(n_gaps):
                self.metrics.itl.observe(gap)
        self.last_token = now
        self.tokens += n

    def finish(self, reason: str) -> None:
        """Records e2e, TPOT and the outcome; only the first call counts."""
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        self.metrics.e2e.observe(now - self.arrival)
        if self.first_token is not None and self.tokens > 1:
            self.metrics.tpot.observe(((self.last_token or now) - self.first_token)
                                      / (self.tokens - 1))
        self.metrics.success.labels(finished_reason=reason).inc()


SLOW_MAX_AGE_S = 1.0


class ServerMetrics:
    """One app's metrics: a live registry (engine collector, outcomes) rendered on every
    scrape, and a slow one (latency histograms, extras) rendered at most once a second."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(stats, model_name))
        self.slow_registry = CollectorRegistry(auto_describe=False)
        self._slow_text = b""
        self._slow_at = -SLOW_MAX_AGE_S
        reg: dict[str, Any] = {"registry": self.slow_registry}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, **reg).labels(
                model_name=model_name)

        self.ttft = hist(wire.M_TTFT, "Time to first token.", _TTFT_BUCKETS)
        self.tpot = hist(wire.M_TPOT, "Mean time per output token after the first, per request.",
                         _TOKEN_BUCKETS)
        self.itl = hist(wire.M_ITL, "Time between consecutive output tokens.", _TOKEN_BUCKETS)
        self.e2e = hist(wire.M_E2E, "Request latency, arrival to last token.", _E2E_BUCKETS)
        self._success = Counter(REQUEST_SUCCESS.removesuffix("_total"),
                                "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.success = _Bound(self._success, model_name)
        for reason in ("stop", "length", "abort"):  # present from the first scrape, like vLLM
            self.success.labels(finished_reason=reason)

    def clock(self) -> RequestClock:
        return RequestClock(self)

    def register_extra(self, collector: Any) -> None:
        self.slow_registry.register(collector)

    def render(self) -> bytes:
        now = time.monotonic()
        if now - self._slow_at >= SLOW_MAX_AGE_S:
            self._slow_text = generate_latest(self.slow_registry)
            self._slow_at = now
        return generate_latest(self.registry) + self._slow_text


@dataclass(slots=True)
class _Bound:
    """`counter.labels(finished_reason=...)` with model_name already filled in."""

    counter: Counter
    model_name: str

    def labels(self, *, finished_reason: str) -> Any:
        return self.counter.labels(model_name=self.model_name, finished_reason=finished_reason)
