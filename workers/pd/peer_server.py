"""The prefill worker's peer transfer endpoint: decode workers pull held blocks here.

A hold is claimed once (a second pull of the same request is refused) and
given back when the connection ends, sent or not, so the prefill worker's
blocks are freed right after the pull instead of at the hold's timeout.
Blocks are gathered and checksummed in a thread, `CHUNK_BLOCKS` at a time,
while the previous chunk drains to the socket: memory stays bounded and the
event loop keeps serving HTTP. The request id is an unguessable capability
(uuid4), valid until the hold ends; the port should be reachable from the
pool only (a NetworkPolicy in Kubernetes, loopback in the local stack).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvyard.kvstore.codec import HEADER_BYTES, encode_header
from kvyard.kvstore.layout import Namespace

from .peer_wire import PeerError, message, read_message

log = logging.getLogger("kvyard.pd")
CHUNK_BLOCKS = 16
REQUEST_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 60.0


@dataclass(slots=True)
class PeerServer:
    engine: Any                  # AsyncLLMEngine: claim_hold, finish_hold, gather_blocks
    namespace: Namespace
    engine_id: str
    host: str = "127.0.0.1"
    port: int = 0                # 0: an ephemeral port, known after start
    server: asyncio.AbstractServer | None = field(default=None, init=False)
    sent_blocks: int = field(default=0, init=False)

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rid = None
        try:
            req = await asyncio.wait_for(read_message(reader), REQUEST_TIMEOUT_S)
            if req.get("remote_engine_id") != self.engine_id:
                raise PeerError("unknown_engine", "remote_engine_id is not this worker's")
            rid = str(req.get("remote_request_id"))
            hold = self.engine.claim_hold(rid)
            if hold is None:
                rid = None
                raise PeerError("unknown_request", "no such hold (pulled already, or expired)")
            n = min(int(req.get("num_blocks", len(hold.block_ids))), len(hold.block_ids))
            lay = self.namespace.layout
            writer.write(message({"ok": True, "num_blocks": n, "block_bytes": lay.nbytes}))
            for s in range(0, n, CHUNK_BLOCKS):
                ids = hold.block_ids[s:s + CHUNK_BLOCKS]
                frames = await asyncio.to_thread(self._frames, ids, hold.block_hashes[s:s + len(ids)])
                await asyncio.wait_for(writer.drain(), SEND_TIMEOUT_S)
                writer.write(memoryview(frames).cast("B"))
                self.sent_blocks += len(ids)
            await asyncio.wait_for(writer.drain(), SEND_TIMEOUT_S)
        except PeerError as e:
            writer.write(message({"ok": False, "error": str(e), "reason": e.reason}))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ValueError) as e:
            log.warning("peer transfer of %s ended early: %s", rid, e)
        finally:
            if rid is not None:
                self.engine.finish_hold(rid)
            writer.close()

    def _frames(self, block_ids: list[int], hashes: list[int]) -> np.ndarray:
        lay = self.namespace.layout
        frames = np.empty((len(block_ids), HEADER_BYTES + lay.nbytes), dtype=np.uint8)
        self.engine.gather_blocks(block_ids, frames[:, HEADER_BYTES:])
        for row, h in zip(frames, hashes):
            row[:HEADER_BYTES] = np.frombuffer(
                encode_header(self.namespace.key(h), lay, row[HEADER_BYTES:]), dtype=np.uint8)
        return frames
