"""The worker's KV-cache events, published as vLLM publishes them (`--kv-events-config`;
the wire: kvyard.common.kv_events), so a precise prefix scorer (kvyard's EPP, llm-d's
kv-cache manager) can index what every worker holds.

The block manager calls `on_event` on the engine thread, inside a step: it only
queues the event. A publisher thread drains what has queued into one batch (a
step's events travel together), sends (topic, seq, payload) on the PUB socket and
keeps the last `buffer_steps` batches for replays on the ROUTER socket. Why a
thread and not the event loop: ZMQ sockets are not thread-safe, and this keeps
them on one thread with the replay polling beside the sends.

Off unless configured: the events carry the prompts' token ids (a subscriber learns
what was asked), so their endpoints belong on the pod network, behind a
NetworkPolicy, like the metrics port.

Never wrong, at worst less precise: when more than `max_queue_size` events wait (a
subscriber far behind does not cause it: PUB drops for slow subscribers at its
high-water mark, as in vLLM), the waiting events are dropped, counted, and an
`AllBlocksCleared` goes out in their place, so subscribers forget this worker's
blocks instead of trusting a view with holes in it; the cache fills their index
again as it is used.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvyard.common import kv_events as wire_events
from kvyard.common import wire

log = logging.getLogger("kvyard.kv_events")


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter(wire.M_KV_EVENT_BATCHES.removesuffix("_total"),
                               "KV-event batches published (--kv-events-config).",
                               registry=registry)
        self.dropped = Counter(wire.M_KV_EVENTS_DROPPED.removesuffix("_total"),
                               "KV events dropped because too many waited (an AllBlocksCleared "
                               "went out instead).", registry=registry)


@dataclass(slots=True)
class KVEventPublisher:
    config: wire_events.KVEventsConfig
    metrics: KVEventMetrics
    seq: int = 0
    _queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _pending: int = 0            # events queued, not yet drained
    _lost: int = 0               # events refused at the cap since the last batch
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _buffer: deque = field(init=False)
    _thread: threading.Thread | None = None
    _running: bool = False
    _ready: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None

    def __post_init__(self) -> None:
        self._buffer = deque(maxlen=self.config.buffer_steps)

    # ---- the engine thread -----------------------------------------------------
    def on_event(self, ev: Any) -> None:
        """A block-manager KVEvent (engine thread: cheap, never blocks)."""
        if ev.kind == "stored":
            item = wire_events.block_stored(ev.block_hashes, ev.parent_block_hash,
                                            ev.token_ids, ev.block_size, ev.lora_name)
        elif ev.kind == "removed":
            item = wire_events.block_removed(ev.block_hashes)
        else:
            item = wire_events.all_blocks_cleared()
        with self._lock:
            if self._pending >= self.config.max_queue_size:
                self._lost += 1              # the publisher clears and counts
                return
            self._pending += 1
        self._queue.put(item)

    # ---- lifecycle ----------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> None:
        """Binds (or connects) the sockets on the publisher thread; raises what failed."""
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvyard-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("the KV-event publisher did not start")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._running = False
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(5.0)

    # ---- the publisher thread ------------------------------------------------------
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        cfg = self.config
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(cfg.hwm)
            if "*" in cfg.endpoint or "::" in cfg.endpoint or \
                    cfg.endpoint.startswith(("ipc://", "inproc://")):
                pub.bind(cfg.endpoint)        # vLLM's rule: a wildcard binds, else connect
            else:
                pub.connect(cfg.endpoint)
            if cfg.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(cfg.replay_endpoint)
        except Exception as e:  # noqa: BLE001 - start() raises it in the caller
            self._error = RuntimeError(f"--kv-events-config: cannot open {cfg.endpoint}: {e}")
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        log.info("publishing KV events on %s (topic %r, replay %s)", cfg.endpoint, cfg.topic,
                 cfg.replay_endpoint or "off")
        topic = cfg.topic.encode()
        try:
            while self._running:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay, topic)
                try:
                    first = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if first is None:
                    break
                events, dropped = self._drain(first)
                payload = wire_events.encode_batch(time.time(), events)
                pub.send_multipart((topic, self.seq.to_bytes(8, "big"), payload))
                self._buffer.append((self.seq, payload))
                self.seq += 1
                self.metrics.batches.inc()
                if dropped:
                    self.metrics.dropped.inc(dropped)
                    log.warning("dropped %d KV events (more than %d waited): published "
                                "AllBlocksCleared instead", dropped, cfg.max_queue_size)
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _drain(self, first: Any) -> tuple[list[dict[str, Any]], int]:
        """Everything queued now, as one batch; with overflow, the cleared marker."""
        items = [first]
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._running = False
                break
            items.append(item)
        with self._lock:
            lost, self._lost = self._lost, 0
            self._pending -= len(items)
        if not lost:
            return items, 0
        # events were refused at the cap: a view built from the rest would have holes
        return [wire_events.all_blocks_cleared()], lost + len(items)

    def _serve_replay(self, replay: Any, topic: bytes) -> None:
        """vLLM >= 0.26's replies: (b"", topic, seq, payload), then the END_SEQ marker."""
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", topic, wire_events.END_SEQ, b""))
