"""A worker's P/D parts, built once the engine runs: the peer server (prefill and
both roles), the decoder, the metrics, the offer.

The KV namespace is this worker's model identity (name + weights fingerprint)
and its KV cache's layout, read from the bound cache: the same digest the
kvstore keys blocks with, so the two paths agree on what a block is.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvyard.common import pd_auth
from kvyard.kvstore.layout import Namespace

from .decode import PDDecoder
from .flags import PDOptions
from .metrics import HoldCollector, PDMetrics
from .params import Offer
from .peer_server import PeerServer


@dataclass(slots=True)
class PDRuntime:
    options: PDOptions
    metrics: PDMetrics
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    namespace: Namespace | None = None
    peer: PeerServer | None = None
    decoder: PDDecoder | None = None

    async def start(self, engine: Any) -> None:
        from kvyard.workers.kvconnector import model_identity_of

        o = self.options
        key = pd_auth.load_key(o.key_file)
        self.namespace = Namespace(model_identity_of(engine.config.model), engine.kv_layout)
        if o.role != "decode":
            self.peer = PeerServer(engine.handoff, self.namespace, self.engine_id, o.peer_host,
                                   o.peer_port)
            await self.peer.start()
            self.metrics.registry.register(HoldCollector(lambda: self._hold_counts(engine)))
        # any role decodes when the EPP asks it to (a `both` pod, or a prefill pod that is
        # the only one left); the peer server is for the roles that prefill for others
        self.decoder = PDDecoder(key, self.namespace, self.metrics, o.prefill_timeout_s,
                                 o.transfer_timeout_s, engine.config.kv_connector,
                                 o.transports, stream=o.stream)
        engine.on_remote_kv_loaded = self.decoder.loaded

    def _hold_counts(self, engine: Any) -> tuple[int, dict[str, int]]:
        holds = engine.handoff.holds
        return holds.num_blocks, {"pulled": self.peer.pulled, "aborted": self.peer.aborted,
                                  "expired": holds.expired_total}

    def peer_info(self) -> dict[str, Any] | None:
        """/health's `kv_peer`: where decode workers open streamed pulls (peer_stream.py)."""
        if self.peer is None:
            return None
        return {"engine_id": self.engine_id, "port": self.peer.port, "shm": self.peer.shm_ready}

    def offer(self, request_id: str, hold: Any) -> dict[str, Any] | None:
        """kv_transfer_params for a finished prefill whose blocks are held."""
        if self.peer is None or self.namespace is None:
            return None
        return Offer(self.engine_id, request_id, self.options.advertise_host, self.peer.port,
                     hold.block_ids, hold.block_hashes, self.namespace.layout.block_size,
                     self.namespace.digest.hex(), self.peer.shm_ready).to_params()

    async def stop(self) -> None:
        if self.peer is not None:
            await self.peer.stop()
        if self.decoder is not None:
            await self.decoder.close()
