"""The replicas' pub/sub of picks (see the package docstring for the design)."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack
import zmq
import zmq.asyncio

from ..scheduling.types import Decision, SchedRequest
from .apply import PickApplier
from .peers import DnsPeers
from .wire import Pick, decode, encode, pick_of

log = logging.getLogger("kvyard.epp.replicas")


def _bind_pair(pub: zmq.Socket, router: zmq.Socket, host: str) -> int:
    for _ in range(50):
        port = pub.bind_to_random_port(f"tcp://{host}", 20000, 60000)
        try:
            router.bind(f"tcp://{host}:{port + 1}")
            return port
        except zmq.ZMQError:
            pub.unbind(pub.getsockopt(zmq.LAST_ENDPOINT))
    raise OSError("no free adjacent port pair for the replicas' pub/sub")


@dataclass(slots=True)
class PickBus:
    applier: PickApplier
    port: int  # PUB; the snapshot ROUTER binds port + 1
    peers: list[str] = field(default_factory=list)  # host:port of peers' PUBs
    dns: DnsPeers | None = None
    host: str = "0.0.0.0"
    catch_up_timeout_s: float = 5.0
    snapshot_window_s: float = 30.0
    snapshot_max: int = 50_000
    dns_period_s: float = 5.0
    rid: bytes = field(default_factory=lambda: os.urandom(8))
    caught_up: bool = False
    sent: int = 0
    received: int = 0
    messages: int = 0
    applied: int = 0
    _ctx: zmq.asyncio.Context | None = None
    _pub: zmq.asyncio.Socket | None = None
    _sub: zmq.asyncio.Socket | None = None
    _router: zmq.asyncio.Socket | None = None
    _connected: set[str] = field(default_factory=set)
    _out: list[Pick] = field(default_factory=list)
    _recent: deque = field(default_factory=deque)  # Picks, oldest first
    _tasks: list[asyncio.Task] = field(default_factory=list)
    # Picks applied lately, by (address, time, learned): a pick that arrives both live and
    # in a snapshot (a replica catching up while its peer keeps picking) counts once.
    _seen: set = field(default_factory=set)
    _seen_order: deque = field(default_factory=deque)
    ports: dict[str, int] = field(default_factory=dict)

    # ---- sending -----------------------------------------------------------------
    def record(self, req: SchedRequest, d: Decision) -> None:
        """A local pick (Director.on_pick): queued, sent at the end of this loop turn."""
        self._queue(pick_of(req, d, time.time()))

    def learned(self, address: str, hashes: list[int]) -> None:
        """A local pick's whole prompt, once hashed (Finisher.on_learn)."""
        self._queue([Pick(address, hashes, {}, time.time(), learned=True)])

    def _queue(self, picks: list[Pick]) -> None:
        if not self._out:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (tests driving the director directly)
                pass
        self._out.extend(picks)
        self._recent.extend(picks)
        while len(self._recent) > self.snapshot_max:
            self._recent.popleft()

    def flush(self) -> None:
        out, self._out = self._out, []
        if out and self._pub is not None:
            try:  # PUB never blocks: past the high-water mark ZMQ drops, as it should
                self._pub.send(encode(self.rid, out), zmq.NOBLOCK)
                self.sent += len(out)
            except zmq.ZMQError as e:
                log.warning("replica pub/sub send failed: %s", e)

    def announce(self) -> None:
        """An empty batch: lets a new peer (or a test) see the link is up."""
        if self._pub is not None:
            self._pub.send(encode(self.rid, []), zmq.NOBLOCK)

    def _window(self) -> list[Pick]:
        cut = time.time() - self.snapshot_window_s
        while self._recent and self._recent[0].t < cut:
            self._recent.popleft()
        return list(self._recent)

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for s in (self._pub, self._router, self._sub):
            s.setsockopt(zmq.LINGER, 0)
        if self.port:
            self._pub.bind(f"tcp://{self.host}:{self.port}")
            self._router.bind(f"tcp://{self.host}:{self.port + 1}")
        else:  # tests: a free adjacent pair
            self.port = _bind_pair(self._pub, self._router, self.host)
        self.ports = {"pub": self.port}
        self._tasks = [asyncio.create_task(self._receive()),
                       asyncio.create_task(self._serve_snapshots())]
        if self.dns is not None:
            self._tasks.append(asyncio.create_task(self._follow_dns()))
        await self.connect(self.peers)
        self._tasks.append(asyncio.create_task(self._catch_up()))

    async def connect(self, peers: list[str]) -> None:
        assert self._sub is not None
        for p in peers:
            if p not in self._connected:
                self._connected.add(p)
                self._sub.connect(f"tcp://{p}")

    async def _follow_dns(self) -> None:
        assert self.dns is not None
        while True:
            now = await self.dns.resolve()
            await self.connect(now)
            for gone in self._connected - set(now) - set(self.peers):  # a pod that left
                self._connected.discard(gone)
                self._sub.disconnect(f"tcp://{gone}")
            await asyncio.sleep(self.dns_period_s)  # Endpoints change on pod churn only

    async def _receive(self) -> None:
        assert self._sub is not None
        while True:
            data = await self._sub.recv()
            try:
                sender, picks = decode(data)
            except (ValueError, TypeError, msgpack.UnpackException) as e:
                log.warning("replica pub/sub: bad message (%s)", e)
                continue
            if sender == self.rid:
                continue
            self.messages += 1
            self.received += len(picks)
            try:
                self._apply(picks, count=True)
            except Exception:  # noqa: BLE001 - one bad pick must not stop the subscription
                log.exception("replica pub/sub: applying a peer's picks failed")

    def _apply(self, picks: list[Pick], count: bool) -> None:
        new = []
        for p in picks:
            key = (p.address, p.t, p.learned)
            if key not in self._seen:
                self._seen.add(key)
                self._seen_order.append(key)
                new.append(p)
        while len(self._seen_order) > self.snapshot_max:
            self._seen.discard(self._seen_order.popleft())
        self.applied += self.applier.apply(new, count)
        self._recent.extend(new)  # a later replica's snapshot has them too

    async def _serve_snapshots(self) -> None:
        assert self._router is not None
        while True:
            client, _, _ = await self._router.recv_multipart()
            await self._router.send_multipart([client, b"", encode(self.rid, self._window())])

    async def _catch_up(self) -> None:
        """Asks each peer for its recent picks; ready after the first answer (or timeout)."""
        peers = list(self._connected)
        if self.dns is not None and not peers:
            peers = await self.dns.resolve()
        deadline = time.monotonic() + self.catch_up_timeout_s
        try:
            if peers:
                await asyncio.wait_for(self._ask(peers), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            log.warning("no replica answered a snapshot in %.1fs; serving without one",
                        self.catch_up_timeout_s)
        except (zmq.ZMQError, ValueError, TypeError, msgpack.UnpackException) as e:
            log.warning("replica snapshot failed (%s); serving without one", e)
        finally:  # never left unready: the peers' live picks still arrive
            self.caught_up = True

    async def _ask(self, peers: list[str]) -> None:
        assert self._ctx is not None
        socks = []
        for p in peers:
            host, _, port = p.rpartition(":")
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{host}:{int(port) + 1}")
            await s.send_multipart([b"", b"snapshot"])
            socks.append(s)
        try:
            pending = {asyncio.ensure_future(s.recv_multipart()) for s in socks}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    sender, picks = decode(f.result()[-1])
                    if sender != self.rid:
                        self._apply(picks, count=False)
                        for f2 in pending:
                            f2.cancel()
                        return
        finally:
            for s in socks:
                s.close()

    def snapshot(self) -> dict:
        return {"peers": sorted(self._connected), "caught_up": self.caught_up,
                "sent": self.sent, "received": self.received, "applied": self.applied}

    async def close(self) -> None:
        self.flush()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(0)
