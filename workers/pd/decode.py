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
from dataclasses import dataclass, field
from typing import Any, Mapping

import aiohttp

from kvyard.common import pd_auth, wire
from kvyard.common.hashing import block_hashes
from kvyard.kvstore.layout import Namespace
from kvyard.workers.engine.api import RemoteKV
from kvyard.workers.server.errors import ApiError

from .metrics import PDMetrics
from .params import Offer, prefill_leg_body
from .peer_client import pull
from .peer_shm import ShmUnavailable, pull_shm
from .peer_wire import PeerError
from .shm_pool import ShmPool

log = logging.getLogger("kvyard.pd")


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
    _session: aiohttp.ClientSession | None = field(default=None, init=False)

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
                        prompt_ids: list[int]) -> RemoteKV | None:
        """The prompt's leading blocks from the prefill worker (or the store), or None."""
        bs = self.namespace.layout.block_size
        own = block_hashes(prompt_ids, bs)[:(len(prompt_ids) - 1) // bs]
        if not own:
            return None
        try:
            t_leg = time.perf_counter()
            offer = await self._prefill(target, path, body)
            self.metrics.phases.labels(phase="prefill_leg").observe(time.perf_counter() - t_leg)
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
        got = await self._from_store(own)
        if got is not None:
            log.info("P/D handoff from %s failed (%s); %d blocks from the store",
                     target, why, len(got.payloads))
            return got
        log.warning("P/D handoff from %s failed (%s): prefilling locally", target, why)
        self.metrics.fallbacks.labels(reason=reason).inc()
        return None

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

    async def _prefill(self, target: str, path: str, body: dict[str, Any]) -> Offer:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.prefill_timeout_s)
        try:
            async with self._session.post(f"http://{target}{path}", json=prefill_leg_body(body),
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
        self.shm_pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
