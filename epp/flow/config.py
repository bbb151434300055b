"""The `flowControl` section of the EPP's scheduler config, typed and checked at load.

Names follow llm-d-router's flow control (protocols.md §3) where the idea is
the same, so configs read alike:

    flowControl:
      maxRequests: 5000            # held requests, all priorities together
      maxBytes: 1073741824         # their request bodies, bytes
      defaultRequestTTL: 60s       # longest wait in a saturation queue -> 429
      noEndpointRequestTTL: 300s   # longest wait in the waiting room -> 503
      queueWhenSaturated: true     # non-sheddable requests wait while the pool is saturated
      priorityBands:               # per-priority bounds (others get the global ones)
        - {priority: 0, maxRequests: 5000, maxBytes: 1073741824}

Durations are seconds (a number) or strings like `500ms`, `60s`, `5m`. Unlike
llm-d, a TTL of 0 is refused: a held request must end, so "wait forever" is
not a setting; a very small TTL answers at once. A TTL above
`kvyard.common.wire.MAX_HOLD_S` (900 s, the gateway's ext_proc
max_message_timeout) is refused: Envoy would end the hold first.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvyard.common.wire import MAX_HOLD_S

from ..scheduling.plugin_config import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_KEYS = ("maxRequests", "maxBytes", "defaultRequestTTL", "noEndpointRequestTTL",
         "queueWhenSaturated", "priorityBands")


@dataclass(slots=True, frozen=True)
class Band:
    priority: int
    max_requests: int
    max_bytes: int


@dataclass(slots=True)
class FlowConfig:
    max_requests: int = 5000
    max_bytes: int = 1 << 30
    default_ttl_s: float = 60.0
    no_endpoint_ttl_s: float = 300.0
    queue_when_saturated: bool = True
    bands: dict[int, Band] = field(default_factory=dict)

    def band(self, priority: int) -> Band:
        b = self.bands.get(priority)
        return b if b is not None else Band(priority, self.max_requests, self.max_bytes)


def duration_s(v: Any, path: str) -> float:
    if isinstance(v, bool):
        raise ConfigError(path, f"must be a duration (e.g. 60s), got {v!r}")
    if isinstance(v, (int, float)):
        s = float(v)
    else:
        m = _DURATION.match(str(v))
        if m is None:
            raise ConfigError(path, f"must be a duration like 500ms, 60s or 5m, got {v!r}")
        s = float(m.group(1)) * _UNITS[m.group(2)]
    if not s > 0:
        raise ConfigError(path, "must be > 0 (a held request must end; a tiny TTL answers "
                                "at once)")
    if s > MAX_HOLD_S:
        raise ConfigError(path, f"at most {MAX_HOLD_S:g}s, the gateway's longest hold "
                                "(ext_proc max_message_timeout)")
    return s


def _count(v: Any, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(path, f"must be an integer >= 1, got {v!r}")
    return v


def parse_flow_config(raw: Any, path: str = "flowControl") -> FlowConfig:
    if raw is None:
        return FlowConfig()
    if not isinstance(raw, dict):
        raise ConfigError(path, "must be a mapping")
    for k in raw:
        if k not in _KEYS:
            raise ConfigError(f"{path}.{k}", f"unknown key; known: {list(_KEYS)}")
    cfg = FlowConfig()
    if "maxRequests" in raw:
        cfg.max_requests = _count(raw["maxRequests"], f"{path}.maxRequests")
    if "maxBytes" in raw:
        cfg.max_bytes = _count(raw["maxBytes"], f"{path}.maxBytes")
    if "defaultRequestTTL" in raw:
        cfg.default_ttl_s = duration_s(raw["defaultRequestTTL"], f"{path}.defaultRequestTTL")
    if "noEndpointRequestTTL" in raw:
        cfg.no_endpoint_ttl_s = duration_s(raw["noEndpointRequestTTL"],
                                           f"{path}.noEndpointRequestTTL")
    if "queueWhenSaturated" in raw:
        q = raw["queueWhenSaturated"]
        if not isinstance(q, bool):
            raise ConfigError(f"{path}.queueWhenSaturated", f"must be true or false, got {q!r}")
        cfg.queue_when_saturated = q
    bands = raw.get("priorityBands") or []
    if not isinstance(bands, list):
        raise ConfigError(f"{path}.priorityBands", "must be a list")
    for i, b in enumerate(bands):
        where = f"{path}.priorityBands[{i}]"
        if not isinstance(b, dict) or "priority" not in b:
            raise ConfigError(where, "must be a mapping with a `priority`")
        for k in b:
            if k not in ("priority", "maxRequests", "maxBytes"):
                raise ConfigError(f"{where}.{k}", "unknown key; known: priority, maxRequests, "
                                                  "maxBytes")
        p = b["priority"]
        if isinstance(p, bool) or not isinstance(p, int):
            raise ConfigError(f"{where}.priority", f"must be an integer, got {p!r}")
        if p in cfg.bands:
            raise ConfigError(f"{where}.priority", f"priority {p} is listed twice")
        cfg.bands[p] = Band(p, _count(b.get("maxRequests", cfg.max_requests),
                                      f"{where}.maxRequests"),
                            _count(b.get("maxBytes", cfg.max_bytes), f"{where}.maxBytes"))
    return cfg
