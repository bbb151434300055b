"""Pulling a prefill worker's held blocks over its peer endpoint (peer_wire.py).

Each frame is checked against the key the puller expects for block i (its
namespace digest + the offer's hash i) and its layout before its checksum:
any mismatch, short stream or peer error raises `PeerError`, whose reason
becomes the fallback metric's label; nothing partial is ever handed on.
"""
from __future__ import annotations

import asyncio

from kvyard.kvstore.codec import HEADER_BYTES, CorruptBlock, check_header
from kvyard.kvstore.layout import Namespace

from .peer_wire import PeerError, message, read_message

_READ_LIMIT = 8 << 20


async def pull(host: str, port: int, engine_id: str, request_id: str,
               namespace: Namespace, block_hashes: list[int],
               timeout_s: float) -> list[memoryview]:
    """The blocks' payloads, verified, in order; PeerError on any failure."""
    try:
        return await asyncio.wait_for(
            _pull(host, port, engine_id, request_id, namespace, block_hashes), timeout_s)
    except TimeoutError:
        raise PeerError("transfer_timeout", f"pull from {host}:{port} took over {timeout_s}s") \
            from None
    except asyncio.IncompleteReadError as e:
        raise PeerError("transfer_truncated",
                        f"stream from {host}:{port} ended early ({len(e.partial)} bytes)") from None
    except (ConnectionError, OSError) as e:
        raise PeerError("transfer_failed", f"peer {host}:{port}: {e}") from None


async def _pull(host: str, port: int, engine_id: str, request_id: str,
                namespace: Namespace, block_hashes: list[int]) -> list[memoryview]:
    reader, writer = await asyncio.open_connection(host, port, limit=_READ_LIMIT)
    try:
        writer.write(message({"remote_engine_id": engine_id, "remote_request_id": request_id,
                              "num_blocks": len(block_hashes)}))
        await writer.drain()
        head = await read_message(reader)
        if head.get("ok") is not True:
            raise PeerError("transfer_refused", f"peer refused: {head.get('error')}")
        lay = namespace.layout
        n = head.get("num_blocks")
        if head.get("block_bytes") != lay.nbytes or not isinstance(n, int) \
                or not 0 < n <= len(block_hashes):
            raise PeerError("kv_mismatch", f"peer offers {n} blocks of "
                            f"{head.get('block_bytes')} bytes, expected {lay.nbytes}")
        frame = HEADER_BYTES + lay.nbytes
        out: list[memoryview] = []
        for h in block_hashes[:n]:
            mv = memoryview(await reader.readexactly(frame))
            payload = mv[HEADER_BYTES:]
            try:
                check_header(mv[:HEADER_BYTES], namespace.key(h), lay, payload)
            except CorruptBlock as e:
                raise PeerError("transfer_corrupt", f"block {len(out)}: {e}") from None
            out.append(payload)
        return out
    finally:
        writer.close()
