"""A simulated pod's KV events on ZMQ, as the worker publishes them (kvyard.common.kv_events).

Same wire as workers/server/kv_events.py (which the simulator must not import): PUB
messages (topic, 8-byte big-endian sequence number, msgpack EventBatch), one batch per
engine step (split at `--event-batch-size` events, llm-d-inference-sim's knob), the last
`buffer_steps` batches kept for replays on a ROUTER socket. Replies use vLLM >= 0.26's
frames, which carry the topic: (b"", topic, seq, payload) per batch from the requested
sequence number, then (b"", topic, END_SEQ, b"").

Unlike the worker, no thread: hundreds of pods share one event loop, so the PUB socket
sends without blocking (PUB drops at its high-water mark anyway) and the ROUTER is read
by an asyncio task that sleeps in the poller while nobody asks.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvyard.common import kv_events as wire_events

log = logging.getLogger("kvyard.sim.events")
_PORT = re.compile(r":(\d+)$")


def offset_endpoint(endpoint: str, i: int) -> str:
    """Pod `i`'s endpoint: the port plus `i` (llm-d-inference-sim's rule for data-parallel
    ranks), so one flag configures every pod of a process."""
    if i == 0:
        return endpoint
    m = _PORT.search(endpoint)
    if m is None:
        raise ValueError(f"{endpoint!r}: several pods need a TCP endpoint with a port")
    return endpoint[:m.start()] + f":{int(m.group(1)) + i}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard (or ipc/inproc) binds, anything else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def replay_frames(topic: bytes, batches: list[tuple[int, bytes]], first: int) -> list[list[bytes]]:
    """The reply to a replay request from sequence `first`, vLLM >= 0.26's frames."""
    out = [[b"", topic, seq.to_bytes(8, "big"), payload] for seq, payload in batches if seq >= first]
    out.append([b"", topic, wire_events.END_SEQ, b""])
    return out


@dataclass(slots=True)
class SimPublisher:
    config: wire_events.KVEventsConfig
    topic: bytes = b""
    batch_size: int = 0                 # events per batch at most; 0: a step's events together
    tagged_maps: bool = False           # events as maps tagged "type" (newer vLLM's form)
    seq: int = 0
    batches: int = 0
    _buffer: deque = field(init=False)
    _pub: Any = None
    _router: Any = None
    _task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self._buffer = deque(maxlen=self.config.buffer_steps)

    def start(self, ctx: Any) -> None:
        import zmq

        cfg = self.config
        pub = ctx.socket(zmq.PUB)
        try:
            pub.set_hwm(cfg.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            (pub.bind if binds(cfg.endpoint) else pub.connect)(cfg.endpoint)
            if cfg.replay_endpoint:
                self._router = ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(cfg.replay_endpoint)
        except Exception as e:
            pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise RuntimeError(f"KV events: cannot open {cfg.endpoint}: {e}") from None
        self._pub = pub
        if self._router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    def publish(self, events: list[dict[str, Any]]) -> None:
        import zmq

        if self._pub is None or not events:
            return
        n = self.batch_size or len(events)
        for i in range(0, len(events), n):
            payload = wire_events.encode_batch(time.time(), events[i:i + n],
                                               tagged_maps=self.tagged_maps)
            try:
                self._pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload),
                                         flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # no subscriber room: dropped, as PUB does at its high-water mark
            self._buffer.append((self.seq, payload))
            self.seq += 1
            self.batches += 1

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            for reply in replay_frames(self.topic, list(self._buffer), int.from_bytes(start, "big")):
                await self._router.send_multipart([client, *reply])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
