"""One batch of picks on the replicas' pub/sub, and a pick taken from a decision."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from ..scheduling.scorers.precise_prefix import ENGINE_KEYS
from ..scheduling.types import Decision, SchedRequest

# The pick PUB port; the snapshot ROUTER listens on the next one (the chart opens both).
REPLICA_PORT = 9005


@dataclass(slots=True)
class Pick:
    address: str
    hashes: list[int]  # the prompt's block hashes known at the pick (approximate index)
    keys: dict[int, list[int]] = field(default_factory=dict)  # engine block size -> own keys
    t: float = 0.0  # wall time of the pick: peers expire speculative entries from it
    # The whole prompt, hashed after the answer (the finisher's `learn`), not a new pick.
    learned: bool = False

    def row(self) -> list:
        return [self.address, _pack(self.hashes), {bs: _pack(k) for bs, k in self.keys.items()},
                self.t, self.learned]


def _pack(hashes: list[int]) -> bytes:
    """Block hashes are 128-bit (xxh3_128): 16 bytes each, little-endian."""
    return b"".join(h.to_bytes(16, "little") for h in hashes)


def _unpack(data: bytes) -> list[int]:
    return [int.from_bytes(data[i:i + 16], "little") for i in range(0, len(data), 16)]


def pick_of(req: SchedRequest, d: Decision, now: float) -> list[Pick]:
    """The picks a decision made: the primary profile's, and a P/D prefill pod's."""
    views = req.cycle.read(ENGINE_KEYS) or {}
    keys = {bs: v.known() for bs, v in views.items()}
    hashes = list(req.prompt.hashes)
    eps = [d.endpoint] + ([d.prefill] if d.prefill is not None else [])
    return [Pick(e.address, hashes, keys, now) for e in eps]


def encode(sender: bytes, picks: list[Pick]) -> bytes:
    return msgpack.packb([sender, [p.row() for p in picks]], use_bin_type=True)


def decode(data: bytes) -> tuple[bytes, list[Pick]]:
    sender, rows = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return sender, [Pick(a, _unpack(h), {int(k): _unpack(v) for k, v in keys.items()}, t,
                         bool(learned)) for a, h, keys, t, learned in rows]
