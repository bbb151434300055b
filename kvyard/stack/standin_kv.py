"""The stand-in worker's kvstore: the real store, configured by the worker's own
`--kv-*` flags, fed one small block per request.

So a stack of stand-ins exercises what a stack of real workers does with its
store layout (which tiers exist, whether a block one worker wrote is a hit for
another, what happens when Redis goes away, what `kvyard status` shows) in
milliseconds and without a model. Each request's block is keyed by its last user
message; the response says where it was found (`x-standin-kv`: a tier, or miss).
"""
from __future__ import annotations

import argparse
import asyncio

import xxhash

from kvyard.kvstore import KVLayout, KVStore, Namespace
from kvyard.kvstore.flags import store_config
from kvyard.kvstore.metrics import KVStoreCollector

KV_HEADER = "x-standin-kv"
# 4 KiB blocks: big enough to be real values, small enough to cost nothing
LAYOUT = KVLayout("bfloat16", block_size=16, num_layers=1, num_kv_heads=1, head_dim=64)
NAMESPACE = Namespace("standin@0", LAYOUT)


def block_for(text: str) -> tuple[int, bytes]:
    """The block hash and the block's bytes for `text`: any stand-in derives the same."""
    h = xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
    seed = h.to_bytes(16, "little")
    return h, (seed * (LAYOUT.nbytes // len(seed) + 1))[:LAYOUT.nbytes]


class StandinKV:
    """The store of one stand-in, or nothing when no `--kv-*` tier is set."""

    def __init__(self, args: argparse.Namespace) -> None:
        cfg = store_config(args)
        self.store = KVStore.from_config(NAMESPACE, cfg) if cfg.any_tier else None

    def collector(self) -> KVStoreCollector | None:
        return KVStoreCollector(self.store) if self.store is not None else None

    def touch(self, text: str) -> str:
        """Look the text's block up (read and check it where found), store it on a
        miss; the tier it came from, or "miss"."""
        if self.store is None:
            return "off"
        h, want = block_for(text)
        n, tiers = self.store.lookup([h])
        out = bytearray(LAYOUT.nbytes)
        if n and self.store.get_into([h], [out]) == 1 and out == want:
            return tiers[0]
        self.store.put([h], [want])
        return "miss"

    async def atouch(self, text: str) -> str:
        return await asyncio.to_thread(self.touch, text)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
