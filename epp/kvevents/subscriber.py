"""One endpoint's KV-event stream into the index, with losses repaired.

A SUB socket (zmq.asyncio: the task sleeps in the event loop until a message
arrives, so idle endpoints cost no CPU) reads `(topic, seq, EventBatch)`. The
sequence number says what was lost:

* the first message of a subscription with seq > 0 (the EPP restarted, or joined
  late): everything the publisher still buffers is replayed from 0 first;
* seq > last + 1 (a gap: the PUB high-water mark, a network blip): the missing
  batches are replayed from the ROUTER socket (`replay_endpoint`), in order; when
  the replay cannot fill the gap (no replay socket, the buffer moved on, no
  answer) the endpoint's blocks are forgotten rather than trusted with holes;
* seq <= last: the publisher restarted (its sequence starts at 0 again, and so
  does its cache): the endpoint's blocks are forgotten, then caught up as above.

`AllBlocksCleared` (sleep, reset, the worker's own overflow) clears the endpoint in
the index. `EventBatch.data_parallel_rank` picks the endpoint when the pool lists a
data-parallel pod's ranks separately (`ranks`); with one endpoint per stream every
batch is that endpoint's.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvyard.common.kv_events import decode_event_batch, replay_reply

from .index import KVBlockIndex

log = logging.getLogger("kvyard.epp.kvevents")


@dataclass(slots=True)
class Subscription:
    ctx: zmq.asyncio.Context
    endpoint: str                 # the publisher's PUB socket, tcp://host:port
    replay: str | None            # its ROUTER socket, or None
    index: KVBlockIndex
    ranks: dict[int | None, str] = field(default_factory=dict)  # dp rank -> address
    replay_timeout_s: float = 2.0
    last: int | None = None       # last applied sequence number
    batches: int = 0
    gaps: int = 0
    repaired: int = 0
    lost: int = 0                 # gaps no replay could fill (the endpoint was cleared)
    resets: int = 0               # publisher restarts seen
    bad: int = 0                  # undecodable messages
    task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"kv-events {self.endpoint}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        log.info("subscribed to KV events at %s (replay %s)", self.endpoint,
                 self.replay or "off")
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.bad += 1
                    continue
                await self.on_message(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def on_message(self, seq: int, payload: bytes) -> None:
        if self.last is not None and seq <= self.last:
            log.info("KV events from %s restarted at %d (after %d): forgetting its blocks",
                     self.endpoint, seq, self.last)
            self.resets += 1
            self.clear()
        if self.last is None:
            if seq > 0:
                await self.fill(0, seq)  # catch up on what the publisher still has
        elif seq > self.last + 1:
            self.gaps += 1
            if await self.fill(self.last + 1, seq):
                self.repaired += 1
            else:
                log.warning("KV events from %s: batches %d..%d lost and not replayable; "
                            "forgetting its blocks", self.endpoint, self.last + 1, seq - 1)
                self.lost += 1
                self.clear()
        self.apply(seq, payload)

    def clear(self) -> None:
        for addr in set(self.ranks.values()):
            self.index.clear(addr)
        self.last = None

    def apply(self, seq: int, payload: bytes) -> None:
        self.last = seq
        self.batches += 1
        try:
            batch = decode_event_batch(payload)
        except ValueError as e:
            self.bad += 1
            log.warning("KV events from %s: batch %d unreadable: %s", self.endpoint, seq, e)
            return
        addr = self.ranks.get(batch.data_parallel_rank)
        if addr is None and len(self.ranks) == 1:
            addr = next(iter(self.ranks.values()))
        if addr is not None:
            self.index.apply(addr, batch.events)

    async def fill(self, start: int, upto: int) -> bool:
        """Applies the buffered batches [start, upto) from the replay socket; True when
        all of them came (for a catch-up from 0: whatever the buffer still had)."""
        if not self.replay:
            return False
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.replay)
        contiguous = True
        try:
            await d.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await d.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("KV-event replay from %s did not answer", self.replay)
                    return False
                try:
                    seq, payload = replay_reply(await d.recv_multipart())
                except ValueError:
                    self.bad += 1
                    continue
                if seq < 0:
                    break
                if seq >= upto or (self.last is not None and seq <= self.last):
                    continue  # later ones arrive live; earlier ones are applied
                if self.last is not None and seq != self.last + 1:
                    contiguous = False  # the buffer no longer has what is missing
                if self.last is None and start > 0 and seq != start:
                    contiguous = False
                self.apply(seq, payload)
        finally:
            d.close(linger=0)
        return contiguous and (start == 0 or self.last == upto - 1)

    def snapshot(self) -> dict:
        return {"endpoint": self.endpoint, "replay": self.replay,
                "ranks": {str(k): v for k, v in self.ranks.items()}, "last_seq": self.last,
                "batches": self.batches, "gaps": self.gaps, "repaired": self.repaired,
                "lost": self.lost, "resets": self.resets, "bad": self.bad}
