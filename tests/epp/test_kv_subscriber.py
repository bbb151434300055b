"""KV-event subscriptions over real ZMQ sockets: a publisher speaking vLLM's wire (PUB
+ replay ROUTER, vLLM >= 0.26 frames), and the EPP's subscriber converging to the truth
after a late join, a lost batch (replayed), an unrepairable gap, a publisher restart,
AllBlocksCleared from the worker's own overflow, an EPP restart, and pool changes."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Callable

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvyard.common import kv_events as kve
from kvyard.epp.kvevents.index import KVBlockIndex
from kvyard.epp.kvevents.sources import KVEventSources
from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec

BS = 16
ADDR = "127.0.0.1:9"


async def until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)  # a poll interval under a deadline


def _chain(seed: int, blocks: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return ([rng.getrandbits(64) for _ in range(blocks)],
            [rng.randrange(1, 50_000) for _ in range(blocks * BS)])


def _stored(chain: tuple[list[int], list[int]], start: int, end: int) -> dict:
    keys, toks = chain
    return {"type": "BlockStored", "block_hashes": keys[start:end],
            "parent_block_hash": keys[start - 1] if start else None,
            "token_ids": toks[start * BS:end * BS], "block_size": BS, "medium": "GPU"}


class Publisher:
    """vLLM's ZmqEventPublisher in miniature; `send=False` loses a batch on the way
    (it stays replayable), `restart()` starts over at sequence 0 on the same ports."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.topic = f"kv@{ADDR}@m".encode()
        self.seq, self.buffer = 0, []
        self.task = asyncio.create_task(self._serve())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", self.topic, kve.END_SEQ, b""])

    async def publish(self, events: list[dict], send: bool = True, rank: int = 0) -> int:
        payload = kve.encode_batch(time.time(), events, rank)
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)

    async def restart(self) -> None:
        await self.close()
        deadline = time.monotonic() + 10
        while True:  # the old listeners close asynchronously
            try:
                self.pub = self.ctx.socket(zmq.PUB)
                self.pub.bind(self.endpoint)
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.bind(self.replay)
                break
            except zmq.ZMQError:
                self.pub.close(linger=0)
                self.router.close(linger=0)
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)  # retry interval under a deadline
        self.seq, self.buffer = 0, []
        self.task = asyncio.create_task(self._serve())


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def _sources(pub: Publisher, replay: bool = True) -> tuple[KVEventSources, EndpointPool]:
    pool = EndpointPool()
    pool.set_source("static", [EndpointSpec(ADDR, kv_events=pub.endpoint,
                                            kv_replay=pub.replay if replay else None)])
    src = KVEventSources(KVBlockIndex(), pool)
    pool.on_change(src.sync)
    src.sync()
    return src, pool


async def _probe(pub: Publisher, cond: Callable[[], bool], what: str) -> None:
    """Publish empty batches until `cond` (joining takes a moment)."""
    deadline = time.monotonic() + 20
    while not cond():
        await pub.publish([])
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)  # a poll interval under a deadline


async def _joined(src: KVEventSources, pub: Publisher) -> None:
    sub = next(iter(src.subs.values()))
    await _probe(pub, lambda: sub.last is not None and sub.last >= pub.seq - 1,
                 "the subscription to join")


async def test_late_join_and_lost_batches_are_replayed(ctx) -> None:
    pub = Publisher(ctx)
    c1, c2 = _chain(1, 6), _chain(2, 4)
    await pub.publish([_stored(c1, 0, 3)])   # before anyone subscribed: caught up by replay
    src, _ = _sources(pub)
    idx, sub = src.index, next(iter(src.subs.values()))
    try:
        await _joined(src, pub)
        assert idx.size(ADDR) == 3 and sub.gaps == 0
        await pub.publish([_stored(c1, 3, 6)], send=False)      # lost on the way
        await pub.publish([_stored(c2, 0, 4)])
        await until(lambda: idx.size(ADDR) == 10, "the gap repaired")
        assert (sub.gaps, sub.repaired, sub.lost) == (1, 1, 0)
        assert idx.snapshot()["orphans"] == {}
    finally:
        await src.close()
        await pub.close()


async def test_a_gap_without_replay_forgets_instead_of_trusting_holes(ctx) -> None:
    pub = Publisher(ctx)
    src, _ = _sources(pub, replay=False)
    idx, sub = src.index, next(iter(src.subs.values()))
    try:
        await _joined(src, pub)
        c = _chain(3, 4)
        await pub.publish([_stored(c, 0, 2)])
        await until(lambda: idx.size(ADDR) == 2, "the first blocks")
        await pub.publish([{"type": "BlockRemoved", "block_hashes": c[0][:2]}], send=False)
        await pub.publish([_stored(c, 2, 4)])
        await until(lambda: sub.lost == 1, "the gap noticed")
        assert idx.size(ADDR) == 0            # cleared; the orphaned rest waits, unreachable
        assert idx.snapshot()["orphans"] == {ADDR: 2}
    finally:
        await src.close()
        await pub.close()


async def test_publisher_restart_and_all_blocks_cleared_reset_the_endpoint(ctx) -> None:
    pub = Publisher(ctx)
    src, _ = _sources(pub)
    idx, sub = src.index, next(iter(src.subs.values()))
    try:
        await _joined(src, pub)
        await pub.publish([_stored(_chain(4, 5), 0, 5)])
        await until(lambda: idx.size(ADDR) == 5, "the blocks")
        await pub.publish([{"type": "AllBlocksCleared"}])
        await until(lambda: idx.size(ADDR) == 0, "AllBlocksCleared applied")
        await pub.publish([_stored(_chain(5, 3), 0, 3)])
        await until(lambda: idx.size(ADDR) == 3, "blocks after the clear")
        await pub.restart()                     # a new worker process: seq 0, empty cache
        c = _chain(6, 2)
        await pub.publish([_stored(c, 0, 2)])   # lost while the subscriber reconnects
        await _probe(pub, lambda: sub.resets == 1, "the restart noticed")
        await until(lambda: idx.size(ADDR) == 2, "the new process's blocks, replayed")
        assert set(idx.engine[ADDR]) == set(c[0])
    finally:
        await src.close()
        await pub.close()


async def test_epp_restart_catches_up_from_the_replay_buffer(ctx) -> None:
    pub = Publisher(ctx)
    src, _ = _sources(pub)
    try:
        await _joined(src, pub)
        for i in range(5):
            await pub.publish([_stored(_chain(10 + i, 4), 0, 4)])
        await until(lambda: src.index.size(ADDR) == 20, "the first EPP's index")
        before = dict(src.index.blocks)
    finally:
        await src.close()
    src2, _ = _sources(pub)                     # a new EPP, empty index
    try:
        await _joined(src2, pub)
        assert dict(src2.index.blocks).keys() == before.keys()
    finally:
        await src2.close()
        await pub.close()


async def test_the_workers_overflow_clear_reaches_the_index(ctx) -> None:
    """The worker's own publisher (a thread, vLLM's frames): events beyond its queue
    become one AllBlocksCleared, and the index forgets that worker."""
    from kvyard.workers.engine.block_manager import KVEvent
    from kvyard.workers.server.kv_events import KVEventMetrics, KVEventPublisher
    from kvyard.workers.server.testing import free_port

    port, rport = free_port(), free_port()
    cfg = kve.KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                             endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}",
                             max_queue_size=4).with_default_topic(ADDR, "m")
    wpub = KVEventPublisher(cfg, KVEventMetrics(CollectorRegistry()))
    for i in range(6):               # before its thread runs: 4 queued, 2 refused
        wpub.on_event(KVEvent("removed", [i]))
    pool = EndpointPool()
    pool.set_source("static", [EndpointSpec(ADDR, kv_events=f"tcp://127.0.0.1:{port}",
                                            kv_replay=f"tcp://127.0.0.1:{rport}")])
    src = KVEventSources(KVBlockIndex(), pool)
    src.index.apply(ADDR, [_stored(_chain(7, 3), 0, 3)])    # what the EPP believed
    src.sync()
    keys, toks = _chain(8, 2)
    wpub.start()                     # batch 0: AllBlocksCleared in place of the overflow
    try:
        deadline = time.monotonic() + 20
        while set(src.index.engine.get(ADDR, ())) != {k & (2**64 - 1) for k in keys}:
            wpub.on_event(KVEvent("stored", keys, parent_block_hash=None, token_ids=toks,
                                  block_size=BS))   # until one arrives live (joining)
            assert time.monotonic() < deadline, src.snapshot()
            await asyncio.sleep(0.05)  # a poll interval under a deadline
        assert wpub.metrics.dropped._value.get() >= 6   # (a first store may join them)
        sub = next(iter(src.subs.values()))
        assert sub.resets == 0 and sub.bad == 0
    finally:
        await src.close()
        wpub.stop()


async def test_subscriptions_follow_the_pool(ctx) -> None:
    pub = Publisher(ctx)
    src, pool = _sources(pub)
    try:
        await _joined(src, pub)
        await pub.publish([_stored(_chain(8, 2), 0, 2)])
        await until(lambda: src.index.size(ADDR) == 2, "the blocks")
        pool.set_source("static", [EndpointSpec(ADDR)])    # no events any more
        assert src.subs == {} and src.index.size(ADDR) == 0
        pool.set_source("static", [EndpointSpec(ADDR, kv_events=pub.endpoint,
                                                kv_replay=pub.replay)])
        assert len(src.subs) == 1
        await _joined(src, pub)                 # caught up again from the replay buffer
        assert src.index.size(ADDR) == 2
        pool.set_source("static", [])
        assert src.subs == {} and src.index.size(ADDR) == 0
    finally:
        await src.close()
        await pub.close()


async def test_idle_streams_cost_no_cpu(ctx) -> None:
    """Subscriptions wait in the event loop (zmq.asyncio): 40 idle streams, ~no CPU."""
    pubs = [ctx.socket(zmq.PUB) for _ in range(40)]
    ports = [p.bind_to_random_port("tcp://127.0.0.1") for p in pubs]
    pool = EndpointPool()
    pool.set_source("static", [EndpointSpec(f"127.0.0.1:{10_000 + i}",
                                            kv_events=f"tcp://127.0.0.1:{port}")
                               for i, port in enumerate(ports)])
    src = KVEventSources(KVBlockIndex(), pool)
    src.sync()
    try:
        await asyncio.sleep(0.3)   # let every subscription connect (not a sync point)
        t0 = time.process_time()
        await asyncio.sleep(1.0)   # the idle second being measured
        assert time.process_time() - t0 < 0.1
        assert len(src.subs) == 40
    finally:
        await src.close()
        for p in pubs:
            p.close(linger=0)
