"""What every endpoint's engine really holds, built from its KV events.

Keys are our own: each `BlockStored` is re-hashed from its `token_ids` with
`kvyard.common.hashing.block_hashes` (seed `KEY_SEED`, never the engine's),
chained from the parent's own key, at the engine's block size (taken from the
event). So stock vLLM pods, whatever their `PYTHONHASHSEED` or hash function,
and kvyard workers land in one key space, and the request side
(`request_keys.py`) computes the same keys from the prompt. An engine-key ->
own-key map per endpoint lets `BlockRemoved` (which carries engine keys only)
apply, as llm-d-kv-cache does.

A block whose parent engine key is unknown (we subscribed late; an event was
lost and is being replayed) is not dropped: it waits, with its descendants, as
an orphan under that parent key and is indexed as soon as the parent becomes
known — from a replay, a later store, or another endpoint announcing the same
engine key (kvyard workers and vLLM >= PR #51875 hash deterministically, so
engine keys agree across pods; with other engines this hint never matches and
costs nothing). Orphans count against the budget like indexed blocks.

Memory is a byte budget (`max_bytes`), charged per block and per holder from
measured CPython sizes (about 440 bytes for a block one endpoint holds, 220 more
per further holder; a test checks the estimate with tracemalloc); past it the
least recently stored or matched blocks go first. The default (4.4 GB) fits 10
million blocks held once each.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvyard.common.hashing import NONE_HASH, block_hashes, seed_for

KEY_SEED = 0
# Bytes per indexed block (its key, LRU slot, holder dict) and per extra holder (the
# holder entry and its engine-key map slot): CPython 3.11+, measured in the tests.
BLOCK_BYTES = 220
HOLDER_BYTES = 220
DEFAULT_MAX_BYTES = 10_000_000 * (BLOCK_BYTES + HOLDER_BYTES)
# Mediums, best first; the scorer weights a block by the best one an endpoint has.
MEDIUMS = ("GPU", "CPU", "KVSTORE")
MEDIUM_WEIGHT = (1.0, 0.8, 0.5)


def key_seed(lora: Any = None, extra: Any = None) -> int:
    """KEY_SEED for plain token blocks; an adapter's blocks, or blocks with extra keys
    (multimodal inputs, cache salts), are another key space: a request's tokens alone
    never match them, a request for that adapter (`lora`) does."""
    if not lora and not (extra and any(k is not None for k in extra)):
        return KEY_SEED
    return seed_for(f"lora:{lora}|extra:{extra!r}")


def _seed(ev: dict[str, Any]) -> int:
    return key_seed(ev.get("lora_name") or ev.get("lora_id"), ev.get("extra_keys"))


def medium_bit(name: Any) -> int:
    """GPU (or unnamed) 1, CPU 2, anything else (disk, kvstore, LMCache tiers) 4."""
    if name is None or name == "GPU":
        return 1
    return 2 if str(name).upper() in ("CPU", "CPU_TIER", "LOCALCPUBACKEND") else 4


def best_weight(bits: int) -> float:
    return 1.0 if bits & 1 else 0.8 if bits & 2 else 0.5 if bits else 0.0


@dataclass(slots=True)
class _Orphans:
    """Stored events of one endpoint waiting for a parent engine key."""

    waiting: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # parent -> events
    blocks: int = 0


@dataclass(slots=True)
class KVBlockIndex:
    max_bytes: int = DEFAULT_MAX_BYTES
    # own key -> {address: [medium bits, engine key]}, least recently stored first
    blocks: OrderedDict = field(default_factory=OrderedDict, repr=False)
    # address -> engine key -> own key
    engine: dict[str, dict[int, int]] = field(default_factory=dict, repr=False)
    block_size: dict[str, int] = field(default_factory=dict)  # address -> engine block size
    # engine key -> own key, from any endpoint (a hint for unknown parents)
    global_engine: dict[int, int] = field(default_factory=dict, repr=False)
    orphans: dict[str, _Orphans] = field(default_factory=dict, repr=False)
    subscribed: set[str] = field(default_factory=set)  # addresses with an event stream
    holders: int = 0
    evicted: int = 0
    stored: int = 0
    removed: int = 0

    # ---- size ------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        orphan_blocks = sum(o.blocks for o in self.orphans.values())
        return (len(self.blocks) + orphan_blocks) * BLOCK_BYTES + self.holders * HOLDER_BYTES

    def _fit(self) -> None:
        while self.bytes_used > self.max_bytes and self.blocks:
            key, hs = self.blocks.popitem(last=False)
            for addr, (_, ekey) in hs.items():
                self._unmap(addr, ekey, key)
            self.holders -= len(hs)
            self.evicted += 1
        while self.bytes_used > self.max_bytes and self.orphans:
            self.orphans.pop(next(iter(self.orphans)))

    def _unmap(self, addr: str, ekey: int, key: int) -> None:
        m = self.engine.get(addr)
        if m is not None and m.get(ekey) == key:
            del m[ekey]
        if self.global_engine.get(ekey) == key:
            del self.global_engine[ekey]

    # ---- events ------------------------------------------------------------------
    def store(self, addr: str, ev: dict[str, Any]) -> int:
        """A `BlockStored`; returns how many blocks were indexed (0 while orphaned)."""
        ehashes, tokens = ev.get("block_hashes") or [], ev.get("token_ids") or []
        bs = int(ev.get("block_size") or 0)
        if not ehashes or bs < 1 or len(tokens) < bs * len(ehashes):
            return 0
        self.block_size[addr] = bs
        m = self.engine.setdefault(addr, {})
        eparent = ev.get("parent_block_hash")
        if eparent is None:
            parent = NONE_HASH
        else:
            parent = m.get(eparent)
            if parent is None:
                parent = self.global_engine.get(eparent)
            if parent is None:
                o = self.orphans.setdefault(addr, _Orphans())
                o.waiting.setdefault(eparent, []).append(ev)
                o.blocks += len(ehashes)
                self._fit()
                return 0
        n = self._index(addr, ev, parent, m)
        self._fit()
        return n

    def _index(self, addr: str, ev: dict[str, Any], parent: int, m: dict[int, int]) -> int:
        """Indexes `ev` under its own parent key, then any orphans it was waiting for."""
        todo = [(ev, parent)]
        n = 0
        while todo:
            ev, parent = todo.pop()
            bits = medium_bit(ev.get("medium"))
            bs = int(ev["block_size"])
            ehashes = ev["block_hashes"]
            seed = _seed(ev)
            keys = block_hashes(ev["token_ids"][: bs * len(ehashes)], bs, seed=seed,
                                parent=parent)
            for ekey, key in zip(ehashes, keys):
                hs = self.blocks.get(key)
                if hs is None:
                    hs = self.blocks[key] = {}
                else:
                    self.blocks.move_to_end(key)
                cur = hs.get(addr)
                if cur is None:
                    self.holders += 1
                    hs[addr] = [bits, ekey]
                else:
                    cur[0] |= bits
                    cur[1] = ekey
                m[ekey] = key
                self.global_engine[ekey] = key
                n += 1
                self.stored += 1
            o = self.orphans.get(addr)
            if o is not None:
                for ekey, key in zip(ehashes, keys):
                    for child in o.waiting.pop(ekey, ()):
                        o.blocks -= len(child["block_hashes"])
                        todo.append((child, key))
                if not o.waiting:
                    del self.orphans[addr]
        return n

    def remove(self, addr: str, ev: dict[str, Any]) -> None:
        """A `BlockRemoved`: the endpoint no longer holds these blocks in that medium."""
        m = self.engine.get(addr)
        if not m:
            return
        bits = medium_bit(ev.get("medium"))
        for ekey in ev.get("block_hashes") or ():
            key = m.get(ekey)
            if key is None:
                continue
            hs = self.blocks.get(key)
            cur = hs.get(addr) if hs is not None else None
            if cur is None:
                del m[ekey]
                continue
            cur[0] &= ~bits
            if cur[0]:
                continue
            del hs[addr]
            self.holders -= 1
            self._unmap(addr, ekey, key)
            self.removed += 1
            if not hs:
                del self.blocks[key]

    def clear(self, addr: str) -> None:
        """`AllBlocksCleared`, a restart, lost events, or the endpoint left: forget it."""
        m = self.engine.pop(addr, None) or {}
        for ekey, key in m.items():
            hs = self.blocks.get(key)
            if hs is not None and hs.pop(addr, None) is not None:
                self.holders -= 1
                if not hs:
                    del self.blocks[key]
            if self.global_engine.get(ekey) == key:
                del self.global_engine[ekey]
        self.orphans.pop(addr, None)

    def forget(self, addr: str) -> None:
        self.clear(addr)
        self.block_size.pop(addr, None)

    def apply(self, addr: str, events: list[dict[str, Any]]) -> None:
        for ev in events:
            t = ev["type"]
            if t == "BlockStored":
                self.store(addr, ev)
            elif t == "BlockRemoved":
                self.remove(addr, ev)
            else:
                self.clear(addr)

    # ---- queries -------------------------------------------------------------------
    def holders_of(self, key: int) -> dict[str, list[int]] | None:
        """Who holds `key`; a hit counts as use for the LRU (hot prefixes stay)."""
        hs = self.blocks.get(key)
        if hs is not None:
            self.blocks.move_to_end(key)
        return hs

    def size(self, addr: str) -> int:
        return len(self.engine.get(addr, ()))

    def snapshot(self) -> dict[str, Any]:
        return {"blocks": len(self.blocks), "holders": self.holders,
                "bytes": self.bytes_used, "max_bytes": self.max_bytes,
                "evicted": self.evicted, "stored": self.stored, "removed": self.removed,
                "orphans": {a: o.blocks for a, o in self.orphans.items()},
                "per_endpoint": {a: len(m) for a, m in self.engine.items()}}
