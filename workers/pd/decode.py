"""The decode worker's side of a P/D handoff: authorise the target, run the prefill
leg, pull the blocks, and fall back rather than fail.

Order matters for safety: `authorize` checks the EPP's signature
(kvyard.common.pd_auth) before anything else, and a target that fails it is a
403 with nothing ever sent to it. The pull then goes only to the host that was
signed (the prefill's answer cannot redirect it elsewhere).

Any failure after that (the prefill worker dead, slower than the timeout, an
error answer, a mismatched model or layout, a refused, truncated or corrupt
transfer) ends in `None`: the request prefills locally and still succeeds
with the same output. Before that, blocks the prefill worker also saved to a
pool tier this worker shares (the local stack's SSD dir, or Redis) are
read from the store (path "store").

Transport: an offer that says `shm` is pulled through the prefill worker's
same-host endpoint (peer_shm.py) when there is one in this network namespace;
otherwise (another host, or that endpoint absent) over TCP. Both are path "peer".
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

import aiohttp

from kvyard.common import pd_auth, wire
from kvyard.common.hashing import adapter_seed, block_hashes
from kvyard.kvstore.layout import Namespace
from kvyard.workers.engine.api import RemoteKV
from kvyard.workers.server.errors import ApiError

from .metrics import PDMetrics
from .params import Offer, prefill_leg_body
from .peer_client import pull
from .peer_shm import ShmUnavailable, pull_shm
from .peer_stream import NotClaimed, PeerInfo, Streamed, stream_shm, stream_tcp
from .peer_wire import PeerError
from .shm_pool import ShmPool

log = logging.getLogger("kvyard.pd")
_NO_PEER_S = 60.0         # a target without a published peer endpoint is asked again after


@dataclass(slots=True)
class PDDecoder:
    key: bytes | None
    namespace: Namespace
    metrics: PDMetrics
    prefill_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0
    connector: Any = None        # the worker's StoreConnector (its store), or None
    transports: tuple[str, ...] = ("shm", "tcp")   # the peer transports to try, in order
    shm_pool: ShmPool = field(default_factory=ShmPool)   # same-host receive buffers
    stream: bool = True      # pull while the prefill computes (peer_stream.py)
    _session: aiohttp.ClientSession | None = field(default=None, init=False)
    _peers: dict[str, PeerInfo | float] = field(default_factory=dict, init=False)
    _threads: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        64, thread_name_prefix="kvyard-pd-recv"), init=False)
    _legs: set[asyncio.Task] = field(default_factory=set, init=False)

    def authorize(self, headers: Mapping[str, str]) -> str | None:
        """The prefill target to use (the header's first), None without the header;
        a 403 ApiError when the EPP's signature does not cover it."""
        value = headers.get(wire.PREFILLER_HEADER)
        if value is None:
            return None
        why = pd_auth.verify(self.key, value, headers.get(wire.PREFILLER_AUTH_HEADER))
        if why is not None:
            self.metrics.rejected.inc()
            raise ApiError(403, f"prefill target refused: {why}", param=wire.PREFILLER_HEADER,
                           code="prefill_target_refused")
        return value.split(",")[0].strip()

    def unsupported(self) -> None:
        self.metrics.fallbacks.labels(reason="unsupported_request").inc()

    async def remote_kv(self, target: str, path: str, body: dict[str, Any],
                        prompt_ids: list[int], lora_name: str | None = None) -> RemoteKV | None:
        """The prompt's leading blocks from the prefill worker (or the store), or None;
        an adapter's blocks are hashed as the engines hash them (`adapter_seed`)."""
        bs = self.namespace.layout.block_size
        own = block_hashes(prompt_ids, bs, seed=adapter_seed(lora_name))[:(len(prompt_ids) - 1) // bs]
        if not own:
            return None
        streaming = self.stream and bool(self.transports)
        sid = uuid.uuid4().hex if streaming else None
        leg = asyncio.ensure_future(self._leg(target, path, body, sid))
        got: RemoteKV | None = None
        try:
            if streaming:
                got = await self._streamed(target, sid, own, leg)
                if got is not None:
                    return got
            offer = await leg
            n = self._usable(offer, target, own)
            if not self.transports:
                raise PeerError("no_transport", "peer pulls are off (--pd-transports none)")
            t0 = time.perf_counter()
            phases: dict[str, float] = {}
            payloads, transport = await self._pull(offer, own[:n], phases)
            self._count("peer", time.perf_counter() - t0, payloads)
            self.metrics.transfers.labels(transport=transport).inc()
            for ph, secs in phases.items():
                self.metrics.phases.labels(phase=ph).observe(secs)
            return RemoteKV(own[:len(payloads)], payloads)
        except PeerError as e:
            reason, why = e.reason, str(e)
        finally:
            if not leg.done():
                if got is None:
                    leg.cancel()            # a failed handoff: the prefill is not needed
                else:                       # streamed: its answer comes any moment
                    self._legs.add(leg)
                    leg.add_done_callback(self._leg_ended)
        got = await self._from_store(own)
        if got is not None:
            log.info("P/D handoff from %s failed (%s); %d blocks from the store",
                     target, why, len(got.payloads))
            return got
        log.warning("P/D handoff from %s failed (%s): prefilling locally", target, why)
        self.metrics.fallbacks.labels(reason=reason).inc()
        return None

    async def _leg(self, target: str, path: str, body: dict[str, Any],
                   stream_id: str | None) -> Offer:
        t0 = time.perf_counter()
        offer = await self._prefill(target, path, body, stream_id)
        self.metrics.phases.labels(phase="prefill_leg").observe(time.perf_counter() - t0)
        if offer.remote_host == target.rpartition(":")[0]:   # where the next one streams from
            self._peers[target] = PeerInfo(offer.remote_engine_id, offer.remote_port, offer.shm)
        return offer

    def _leg_ended(self, leg: asyncio.Task) -> None:
        self._legs.discard(leg)
        if not leg.cancelled() and leg.exception() is not None:
            log.debug("prefill leg after a streamed handoff: %s", leg.exception())

    async def _streamed(self, target: str, stream_id: str, own: list[int],
                        leg: asyncio.Task) -> RemoteKV | None:
        """The blocks pulled while the prefill runs; None when the stream claimed
        nothing (the offer's pull may then take the hold); PeerError on a failure."""
        info = await self._peer(target)
        if info is None:
            return None
        stream = asyncio.ensure_future(self._stream(target, info, stream_id, own))
        try:
            await asyncio.wait({leg, stream}, return_when=asyncio.FIRST_COMPLETED)
            if not stream.done():
                if leg.exception() is not None:   # no prefill: the stream would wait in vain
                    raise leg.exception()
                await asyncio.wait({stream}, timeout=self.transfer_timeout_s)
                if not stream.done():
                    raise PeerError("transfer_timeout", "the stream did not end after the "
                                    f"prefill answered, in {self.transfer_timeout_s}s")
            res = stream.result()
        except NotClaimed as e:
            log.debug("no streamed pull from %s: %s", target, e)
            if e.reason in ("unreachable", "unknown_engine"):
                self._peers.pop(target, None)     # restarted or gone: learn it again
            return None
        finally:
            if not stream.done():
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
        self._count("peer", res.tail_s, res.payloads)
        self.metrics.transfers.labels(transport=res.transport).inc()
        self.metrics.phases.labels(phase="stream_tail").observe(res.tail_s)
        self.metrics.streamed.labels(when="during_prefill").inc(res.early)
        self.metrics.streamed.labels(when="after_prefill").inc(len(res.payloads) - res.early)
        return RemoteKV(own[:len(res.payloads)], res.payloads)

    async def _stream(self, target: str, info: PeerInfo, stream_id: str,
                      own: list[int]) -> Streamed:
        bound = self.prefill_timeout_s + self.transfer_timeout_s
        if "shm" in self.transports and info.shm:
            try:
                return await stream_shm(info, stream_id, self.namespace, own, bound,
                                        self.shm_pool, self._threads)
            except ShmUnavailable as e:
                if "tcp" not in self.transports:
                    raise NotClaimed("unreachable", str(e)) from None
        if "tcp" not in self.transports:
            raise NotClaimed("unreachable", "no transport to stream over")
        return await stream_tcp(target.rpartition(":")[0].strip("[]"), info, stream_id,
                                self.namespace, own, bound, self._threads)

    async def _peer(self, target: str) -> PeerInfo | None:
        """The target's peer endpoint: from its last offer, else its /health."""
        known = self._peers.get(target)
        if isinstance(known, PeerInfo):
            return known
        if known is not None and time.monotonic() < known:
            return None
        info = None
        try:
            async with self._client().get(f"http://{target}/health",
                                          timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                if r.status == 200:
                    info = PeerInfo.from_health(await r.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        if target not in self._peers or not isinstance(self._peers[target], PeerInfo):
            self._peers[target] = info if info is not None else time.monotonic() + _NO_PEER_S
        return info

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _pull(self, offer: Offer, hashes: list[int], phases: dict[str, float]
                    ) -> tuple[list[memoryview], str]:
        if "shm" in self.transports and offer.shm:
            try:
                return await pull_shm(offer.remote_engine_id, offer.remote_request_id,
                                      self.namespace, hashes, self.transfer_timeout_s,
                                      self.shm_pool, phases), "shm"
            except ShmUnavailable as e:  # nothing claimed: TCP takes the same hold
                log.debug("no same-host endpoint for %s: %s", offer.remote_engine_id, e)
        if "tcp" not in self.transports:
            raise PeerError("transfer_failed", "no transport to the prefill worker")
        return await pull(offer.remote_host, offer.remote_port, offer.remote_engine_id,
                          offer.remote_request_id, self.namespace, hashes,
                          self.transfer_timeout_s, phases), "tcp"

    def loaded(self, seconds: float) -> None:
        """The engine copied a handoff's blocks into its cache (the insert phase)."""
        self.metrics.phases.labels(phase="insert").observe(seconds)

    async def _prefill(self, target: str, path: str, body: dict[str, Any],
                       stream_id: str | None = None) -> Offer:
        timeout = aiohttp.ClientTimeout(total=self.prefill_timeout_s)
        try:
            async with self._client().post(f"http://{target}{path}",
                                           json=prefill_leg_body(body, stream_id),
                                           timeout=timeout) as r:
                data = await r.read()
                if r.status != 200:
                    raise PeerError("prefill_error", f"prefill answered {r.status}: "
                                    f"{data[:200].decode(errors='replace')}")
        except TimeoutError:
            raise PeerError("prefill_timeout",
                            f"no prefill answer within {self.prefill_timeout_s}s") from None
        except aiohttp.ClientError as e:
            raise PeerError("prefill_unreachable", f"{type(e).__name__}: {e}") from None
        try:
            return Offer.from_params(json.loads(data).get(wire.KV_TRANSFER_PARAMS))
        except (ValueError, AttributeError) as e:
            raise PeerError("prefill_error", f"bad prefill answer: {e}") from None

    def _usable(self, offer: Offer, target: str, own: list[int]) -> int:
        """How many leading offered blocks this request can use; PeerError if none."""
        if offer.remote_host != target.rpartition(":")[0]:
            raise PeerError("prefill_error", f"offer points at {offer.remote_host}, "
                            f"not the signed host of {target}")
        if offer.kv_namespace != self.namespace.digest.hex() \
                or offer.block_size != self.namespace.layout.block_size:
            raise PeerError("kv_mismatch", "the prefill worker's model or KV layout differs")
        n = 0
        for mine, theirs in zip(own, offer.block_hashes):
            if mine != theirs:
                break
            n += 1
        if n == 0:
            raise PeerError("kv_mismatch", "no offered block matches this prompt's tokens")
        return n

    async def _from_store(self, own: list[int]) -> RemoteKV | None:
        store = getattr(self.connector, "store", None)
        if store is None:
            return None
        t0 = time.perf_counter()
        try:
            views = await asyncio.to_thread(store.get, own)
        except Exception:  # noqa: BLE001 - a failing store is one more reason to prefill
            log.exception("kvstore read for a P/D fallback failed")
            return None
        payloads = []
        for v in views:
            if v is None:
                break
            payloads.append(v)
        if not payloads:
            return None
        self._count("store", time.perf_counter() - t0, payloads)
        self.metrics.phases.labels(phase="transfer").observe(time.perf_counter() - t0)
        return RemoteKV(own[:len(payloads)], payloads)

    def _count(self, path: str, seconds: float, payloads: list) -> None:
        self.metrics.handoffs.labels(path=path).inc()
        self.metrics.seconds.labels(path=path).observe(seconds)
        self.metrics.bytes.inc(sum(memoryview(p).nbytes for p in payloads))

    async def close(self) -> None:
        for leg in list(self._legs):
            leg.cancel()
        self.shm_pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
