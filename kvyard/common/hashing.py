"""Chained token-block hashes: the key of a KV block everywhere in kvyard.

A block's hash covers its own token ids *and* its parent's hash, so equal
hashes mean equal whole prefixes, not just equal blocks. Only full blocks are
hashed (a partial block can still change).

The engine's prefix cache, the kvstore's keys and the EPP's prefix index all
call `block_hashes`, so a block computed by one worker is recognised by the
router and by every other worker. We use xxh3-128 (fast, and 128 bits keep
accidental collisions out of reach even for pool-wide stores); the seed lets
callers keep unrelated hash spaces apart (e.g. the EPP seeds with the model
name). We never depend on an engine's hash seed (see shared/reference §4).
"""
from __future__ import annotations

from array import array
from typing import Sequence

import xxhash

NONE_HASH = 0  # parent of the first block
_ZERO16 = bytes(16)


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, converted once per request."""
    if hasattr(token_ids, "astype"):  # numpy array: no per-item Python work
        return token_ids.astype("<u4", copy=False).tobytes()
    return array("I", token_ids).tobytes()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: int = 0,
    parent: int = NONE_HASH,
    start_block: int = 0,
) -> list[int]:
    """Hashes of the full blocks of `token_ids`, chained from `parent`.

    `start_block` skips blocks whose hashes the caller already has (pass the
    last of them as `parent`), so growing sequences are hashed incrementally.
    Linear in the prompt, one hash call per block.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = _pack(token_ids)
    n_full = len(data) // (4 * block_size)
    step = 4 * block_size
    h = parent
    out: list[int] = []
    hasher = xxhash.xxh3_128_intdigest
    for i in range(start_block, n_full):
        prev = h.to_bytes(16, "little") if h else _ZERO16
        h = hasher(prev + data[i * step:(i + 1) * step], seed)
        out.append(h)
    return out


def seed_for(name: str) -> int:
    """A stable 64-bit seed from a string (e.g. the served model name)."""
    return xxhash.xxh3_64_intdigest(name.encode())


def adapter_seed(lora_name: str | None) -> int:
    """The engine's hash seed for a request's blocks: 0 for the base model, else from the
    LoRA adapter's name, so two adapters (or an adapter and the base) never share KV, and
    an adapter's blocks have the same hashes on every worker (the kvstore keys, P/D)."""
    return 0 if lora_name is None else seed_for("lora:" + lora_name)
