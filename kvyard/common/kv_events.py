"""vLLM's KV-cache events on the wire (../shared/reference/protocols.md §4): what a worker
publishes and what a subscriber (an EPP's precise prefix index, llm-d's kv-cache
manager) reads.

A ZMQ PUB message is three frames: the topic, an 8-byte big-endian sequence number
(from 0, one per batch), and a msgpack `EventBatch`. The batch and its events are
encoded as vLLM's msgspec structs are (`array_like=True`, events tagged): positional
arrays, the tag first:
  [<ts float>, [...events], 0]                       (the last: data_parallel_rank)
  ["BlockStored", [hashes], parent | None, [token_ids], 16, None, "GPU", None]
      (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name)
  ["BlockRemoved", [hashes], "GPU"]
  ["AllBlocksCleared"]
`decode_batch` also reads the map form ({"ts", "events", ...} and events tagged
"type"), which some publishers write. Events are built and read as dicts with "type". Block hashes are unsigned 64-bit integers, as vLLM's external hashes
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`): the low 64 bits of kvyard's chained hashes
(kvyard.common.hashing). Consumers should key blocks by `token_ids` with a hash of
their own and use these only to match removals, as llm-d does: they identify a
block on this worker, not its content anywhere else.

The replay socket (ROUTER): a DEALER sends b"" + the start sequence number (8 bytes
big-endian); each buffered batch from it comes back as (b"", topic, seq, payload),
then (b"", topic, END_SEQ, b"") — vLLM >= 0.26's frames (vllm#45177), which llm-d's
replay consumer reads. `replay_reply` also reads the older topic-less
(b"", seq, payload).

The topic defaults to `kv@<ip:port>@<model>` (`default_topic`): llm-d's consumer reads
the pod and the model from it.

`medium` is "GPU" for the engine's own KV cache on any device: vLLM's name for that
tier, which consumers such as llm-d score as the primary one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

import msgpack

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"
_MASK64 = (1 << 64) - 1


def external_hash(h: int) -> int:
    return h & _MASK64


def block_stored(block_hashes: list[int], parent: int | None, token_ids: list[int],
                 block_size: int, lora_name: str | None = None) -> dict[str, Any]:
    """`lora_name`: the adapter the blocks were computed with (vLLM's field; None: the base)."""
    return {"type": "BlockStored", "block_hashes": [external_hash(h) for h in block_hashes],
            "parent_block_hash": None if parent is None else external_hash(parent),
            "token_ids": list(token_ids), "block_size": block_size, "lora_id": None,
            "medium": MEDIUM, "lora_name": lora_name}


def block_removed(block_hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [external_hash(h) for h in block_hashes],
            "medium": MEDIUM}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def default_topic(address: str, model: str) -> str:
    """`kv@<ip:port>@<model>`, the topic llm-d parses (pod and model)."""
    return f"kv@{address}@{model}"


def encode_batch(ts: float, events: list[dict[str, Any]], dp_rank: int = 0,
                 tagged_maps: bool = False) -> bytes:
    """The positional form vLLM's msgspec structs (`array_like=True`, `tag=True`) write:
    [ts, [[tag, field, ...], ...], dp_rank]; consumers that decode into vLLM's structs
    (vllm-router, llm-d) read only a positional batch. `tagged_maps`: each event as a
    map tagged "type" inside that batch instead, newer vLLM's event form, the only one
    vllm-router >= 0.1.17's kv_aware index accepts ("KV event must be a tagged map")."""
    if tagged_maps:
        rows: list[Any] = [{"type": ev["type"], **{f: ev[f] for f in _POSITIONAL[ev["type"]]
                                                    if f in ev}} for ev in events]
    else:
        rows = [[ev["type"], *(ev.get(f) for f in _POSITIONAL[ev["type"]][:_width(ev)])]
                for ev in events]
    return msgpack.packb([ts, rows, dp_rank])


def _width(ev: dict[str, Any]) -> int:
    """How many positional fields `ev` fills: up to its last key in vLLM's order."""
    names = _POSITIONAL[ev["type"]]
    return max((i + 1 for i, f in enumerate(names) if f in ev), default=0)


# The positional (array_like) form's field order, as vLLM declares the structs.
_POSITIONAL = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                               "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                               "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
               "BlockRemoved": ("block_hashes", "medium", "group_idx"),
               "AllBlocksCleared": ()}


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None = None


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """(ts, events as dicts with "type"); ValueError for what is not an EventBatch."""
    b = decode_event_batch(payload)
    return b.ts, b.events


def decode_event_batch(payload: bytes) -> EventBatch:
    """The batch, its data-parallel rank included; ValueError for what is not one."""
    try:
        doc = msgpack.unpackb(payload, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"not msgpack: {e}") from None
    rank: Any = None
    if isinstance(doc, dict):
        ts, events, rank = doc.get("ts"), doc.get("events"), doc.get("data_parallel_rank")
    elif isinstance(doc, list) and len(doc) >= 2:
        ts, events = doc[0], doc[1]
        rank = doc[2] if len(doc) > 2 else None
    else:
        raise ValueError("not an EventBatch")
    if not isinstance(events, list):
        raise ValueError("EventBatch.events is not a list")
    out = []
    for ev in events:
        if isinstance(ev, list) and ev and ev[0] in _POSITIONAL:
            ev = {"type": ev[0], **dict(zip(_POSITIONAL[ev[0]], ev[1:]))}
        if not isinstance(ev, dict) or ev.get("type") not in _POSITIONAL:
            raise ValueError(f"unknown event {str(ev)[:80]}")
        out.append(ev)
    return EventBatch(float(ts or 0.0), out,
                      rank if isinstance(rank, int) and not isinstance(rank, bool) else None)


def replay_reply(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of one frame set a DEALER reads from the replay socket, with or
    without the topic; seq -1 ends the replay. ValueError for anything else."""
    if len(frames) == 4:
        frames = [frames[0], frames[2], frames[3]]
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"not a replay reply ({len(frames)} frames)")
    return int.from_bytes(frames[1], "big", signed=True), frames[2]


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (a JSON object), the fields kvyard uses."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"            # "zmq" publishes; "null" does not
    endpoint: str = "tcp://*:5557"     # PUB: bound when it has a wildcard, else connected
    replay_endpoint: str | None = None  # ROUTER for replays, bound
    buffer_steps: int = 10_000         # batches kept for replay
    hwm: int = 100_000                 # the PUB socket's high-water mark
    max_queue_size: int = 100_000      # events waiting to be published, at most
    topic: str = ""

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def with_default_topic(self, address: str, model: str) -> "KVEventsConfig":
        """This config, its empty topic replaced by `kv@<address>@<model>`."""
        return self if self.topic else replace(self, topic=default_topic(address, model))

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """ValueError naming the field for anything vLLM would not accept either."""
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
        cfg = cls(**doc)
        for name, kind in (("enable_kv_cache_events", bool), ("publisher", str),
                           ("endpoint", str), ("buffer_steps", int), ("hwm", int),
                           ("max_queue_size", int), ("topic", str)):
            v = getattr(cfg, name)
            if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 1)):
                raise ValueError(f"--kv-events-config.{name}: expected "
                                 f"{'a positive integer' if kind is int else kind.__name__}, "
                                 f"got {v!r}")
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config.publisher: expected zmq or null, "
                             f"got {cfg.publisher!r}")
        if cfg.replay_endpoint is not None and not isinstance(cfg.replay_endpoint, str):
            raise ValueError("--kv-events-config.replay_endpoint: expected a string")
        return cfg
