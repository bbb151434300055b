"""One endpoint's KV-event stream into the index, with losses repaired.

A SUB socket (zmq.asyncio: the task sleeps in the event loop until a message
arrives, so idle endpoints cost no CPU) reads `(topic, seq, EventBatch)`. The
sequence number says what was lost:

* on subscribing (the EPP restarted, or joined late) everything the publisher
  still buffers is replayed from 0 first, and again if the first live batch has
  seq > 0 and nothing was replayed; batches that arrive live and were already
  replayed are recognised by their digest and skipped;
* seq > last + 1 (a gap: the PUB high-water mark, a network blip): the missing
  batches are replayed from the ROUTER socket (`replay_endpoint`), in order,
  starting with the last applied one, which must come back unchanged (else the
  publisher restarted and its new sequence merely passed ours); when the replay
  cannot fill the gap (no replay socket, the buffer moved on, no answer) the
  endpoint's blocks are forgotten rather than trusted with holes;
* seq <= last, or a replay that proves a new stream: the publisher restarted (its
  sequence starts at 0 again, and so does its cache): the endpoint's blocks are
  forgotten, then caught up from 0 as on a first message.

`AllBlocksCleared` (sleep, reset, the worker's own overflow) clears the endpoint in
the index. `EventBatch.data_parallel_rank` picks the endpoint when the pool lists a
data-parallel pod's ranks separately (`ranks`); with one endpoint per stream every
batch is that endpoint's.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvyard.common.kv_events import decode_event_batch, replay_reply

from .index import KVBlockIndex

log = logging.getLogger("kvyard.epp.kvevents")
_RECENT = 4096        # applied batches remembered to tell a duplicate from a restart
_NO_LIMIT = 1 << 62


@dataclass(slots=True)
class Subscription:
    ctx: zmq.asyncio.Context
    endpoint: str                 # the publisher's PUB socket, tcp://host:port
    replay: str | None            # its ROUTER socket, or None
    index: KVBlockIndex
    ranks: dict[int | None, str] = field(default_factory=dict)  # dp rank -> address
    replay_timeout_s: float = 2.0
    last: int | None = None       # last applied sequence number
    topic: str = ""               # the publisher's, e.g. kv@<ip:port>@<model>
    batches: int = 0
    gaps: int = 0
    repaired: int = 0
    lost: int = 0                 # gaps no replay could fill (the endpoint was cleared)
    resets: int = 0               # publisher restarts seen
    bad: int = 0                  # undecodable messages
    task: asyncio.Task | None = None
    _digest: int = 0              # of the last applied batch, to recognise it in a replay
    _recent: OrderedDict = field(default_factory=OrderedDict)  # seq -> digest, applied lately

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
        sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's PUB side keeps as many
        sub.connect(self.endpoint)
        log.info("subscribed to KV events at %s (replay %s)", self.endpoint,
                 self.replay or "off")
        try:
            # what an idle publisher buffered before we joined (live batches sent during
            # the replay are recognised as duplicates by their digest)
            await self.fill(0, _NO_LIMIT)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.bad += 1
                    continue
                self.topic = frames[0].decode(errors="replace")
                await self.on_message(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def on_message(self, seq: int, payload: bytes) -> None:
        if self.last is not None and seq <= self.last:
            if self._recent.get(seq) == hash(payload):
                return  # already applied (from a replay while it was on its way)
            self._restarted(seq)
        if self.last is not None and seq > self.last + 1:
            self.gaps += 1
            status = await self.fill(self.last, seq)
            if status == "restarted":
                self._restarted(seq)
            elif status == "ok":
                self.repaired += 1
            else:
                log.warning("KV events from %s: batches %d..%d lost and not replayable; "
                            "forgetting its blocks", self.endpoint, self.last + 1, seq - 1)
                self.lost += 1
                self.clear()
        if self.last is None and seq > 0:
            await self.fill(0, seq)  # catch up on what the publisher still has
        self.apply(seq, payload)

    def _restarted(self, seq: int) -> None:
        log.info("KV events from %s restarted (batch %d after %s): forgetting its blocks",
                 self.endpoint, seq, self.last)
        self.resets += 1
        self.clear()

    def clear(self) -> None:
        for addr in set(self.ranks.values()):
            self.index.clear(addr)
        self.last = None
        self._recent.clear()

    def apply(self, seq: int, payload: bytes) -> None:
        self.last, self._digest = seq, hash(payload)
        self._recent[seq] = self._digest
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
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

    async def fill(self, start: int, upto: int) -> str:
        """Applies the buffered batches before `upto` from the replay socket, from
        `start` on. With `start` == the last applied batch, the replay first proves it
        is the same stream (that batch must come back unchanged: a restarted publisher
        whose sequence already passed ours would otherwise pass for a gap).
        "ok": all came; "restarted"; "lost": no replay, no answer, or the buffer has
        moved on (for a catch-up from 0, whatever the buffer still has is "ok")."""
        if not self.replay:
            return "lost"
        verify = self.last if self.last is not None and start == self.last else None
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.replay)
        try:
            await d.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await d.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("KV-event replay from %s did not answer", self.replay)
                    return "lost"
                frames = await d.recv_multipart()
                try:
                    seq, payload = replay_reply(frames)
                except ValueError:
                    self.bad += 1
                    continue
                if verify is not None:
                    if seq != verify:
                        return "lost"  # the buffer no longer has it (or ends): unprovable
                    if hash(payload) != self._digest:
                        return "restarted"
                    verify = None
                    continue
                if seq < 0:
                    break
                if len(frames) == 4:
                    self.topic = frames[1].decode(errors="replace")
                if seq >= upto:
                    continue  # arrives live
                if self.last is not None and seq != self.last + 1:
                    return "lost"  # the buffer no longer has what is missing
                self.apply(seq, payload)
        finally:
            d.close(linger=0)
        return "ok" if start == 0 or self.last == upto - 1 else "lost"

    def snapshot(self) -> dict:
        return {"endpoint": self.endpoint, "replay": self.replay,
                "ranks": {str(k): v for k, v in self.ranks.items()}, "last_seq": self.last,
                "topic": self.topic,
                "batches": self.batches, "gaps": self.gaps, "repaired": self.repaired,
                "lost": self.lost, "resets": self.resets, "bad": self.bad}
