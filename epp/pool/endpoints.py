"""The live endpoint pool: who can receive traffic, and how loaded they are.

Discovery sources (file, Kubernetes) each own a subset; the pool is their
union, so two sources never fight over an entry. The scraper writes metrics
into the same `Endpoint` objects the scheduler reads, which keeps the hot path
free of copies: a decision touches plain attributes only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvyard.common.wire import ROLES


@dataclass(slots=True, frozen=True)
class EndpointSpec:
    """What discovery knows: an address, a role and where its KV events are published
    (`epp/kvevents/sources.py`)."""

    address: str  # ip:port
    role: str = "both"
    kv_events: str | None = None  # the worker's PUB socket, tcp://host:port
    kv_replay: str | None = None  # its replay (ROUTER) socket
    dp_rank: int | None = None    # the data-parallel rank this address serves
    pool: str = ""                # its InferencePool (a base model's, epp/models.py); "": the one


@dataclass(slots=True)
class Endpoint:
    """One worker as the scheduler sees it; mutated in place by the scraper."""

    address: str
    role: str = "both"
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    last_ok: float = 0.0  # monotonic time of the last good scrape; 0 = never
    failures: int = 0  # consecutive failed scrapes
    timeouts: int = 0  # consecutive timed-out scrapes tolerated as stale (pool/staleness.py)
    down: bool = False  # dropped from candidates until a scrape succeeds
    sleeping: bool = False  # the worker reports kvyard:sleeping 1 (sleep mode): no traffic
    prompt_tokens_pending: float | None = None  # kvyard:prompt_tokens_pending; None: not exported
    last_error: str = ""
    pending: int = 0  # picks since the last good scrape (not yet in `waiting`)
    picks: int = 0
    prefix_hits: int = 0  # picks that matched at least one cached block
    kv_events: str | None = None  # from the spec: where its KV events are published
    kv_replay: str | None = None
    dp_rank: int | None = None
    pool: str = ""  # from the spec (epp/models.py routes a model to its pool)
    # LoRA, scraped (vllm:lora_requests_info): adapters of running and waiting requests and
    # how many may be active; max_lora None: the worker reports no adapters
    lora_running: frozenset[str] = frozenset()
    lora_waiting: frozenset[str] = frozenset()
    max_lora: int | None = None

    def fresh(self, now: float, stale_after: float) -> bool:
        return self.last_ok > 0.0 and now - self.last_ok <= stale_after

    def current(self, now: float, stale_after: float) -> bool:
        """Fresh, or only late: its scrapes time out within the grace (pool/staleness.py)."""
        return self.fresh(now, stale_after) or (self.timeouts > 0 and not self.down)

    def snapshot(self, now: float, stale_after: float) -> dict:
        return {
            "address": self.address, "role": self.role, "queue": self.waiting,
            "running": self.running, "kv_usage": self.kv_usage, "picks": self.picks,
            "prefix_hits": self.prefix_hits, "fresh": self.fresh(now, stale_after),
            "down": self.down, "sleeping": self.sleeping, "failures": self.failures,
            "stale_scrapes": self.timeouts,
            "pending": self.pending,
            "last_error": self.last_error,
            "age_s": round(now - self.last_ok, 3) if self.last_ok else None,
            **({"pool": self.pool} if self.pool else {}),
            **({"lora_running": sorted(self.lora_running), "max_lora": self.max_lora}
               if self.max_lora is not None else {}),
        }


def parse_spec(entry: object) -> EndpointSpec:
    """Accepts `"ip:port"` or `{address: ip:port, role: ..., kv_events: tcp://ip:5557,
    kv_events_replay: tcp://ip:5558, data_parallel_rank: 0, pool: NAME}`; raises ValueError."""
    events: dict = {}
    if isinstance(entry, str):
        address, role = entry, "both"
    elif isinstance(entry, dict) and isinstance(entry.get("address"), str):
        address, role = entry["address"], str(entry.get("role", "both"))
        events = _event_fields(entry)
    else:
        raise ValueError(f"endpoint entry {entry!r}: want 'ip:port' or {{address, role}}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint address {address!r}: want ip:port")
    if role not in ROLES:
        raise ValueError(f"endpoint {address}: role {role!r} not in {ROLES}")
    return EndpointSpec(address, role, **events)


def _event_fields(entry: dict) -> dict:
    out: dict = {}
    for key, attr in (("kv_events", "kv_events"), ("kv_events_replay", "kv_replay")):
        v = entry.get(key)
        if v is not None:
            if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://")):
                raise ValueError(f"endpoint {entry['address']}: {key} {v!r}: want tcp://host:port")
            out[attr] = v
    pool = entry.get("pool")
    if pool is not None:
        if not isinstance(pool, str) or not pool:
            raise ValueError(f"endpoint {entry['address']}: pool {pool!r}: want a name")
        out["pool"] = pool
    rank = entry.get("data_parallel_rank")
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"endpoint {entry['address']}: data_parallel_rank {rank!r}")
        out["dp_rank"] = rank
    return out


@dataclass(slots=True)
class EndpointPool:
    """Union of discovery sources; notifies listeners when an endpoint leaves
    and when membership changes. `generation` counts discovery updates (0:
    discovery has not run yet) and changes whenever membership does."""

    stale_after: float = 2.0
    generation: int = 0
    _sources: dict[str, dict[str, EndpointSpec]] = field(default_factory=dict)
    _endpoints: dict[str, Endpoint] = field(default_factory=dict)
    _on_remove: list[Callable[[str], None]] = field(default_factory=list)
    _on_change: list[Callable[[], None]] = field(default_factory=list)

    def on_remove(self, fn: Callable[[str], None]) -> None:
        self._on_remove.append(fn)

    def on_change(self, fn: Callable[[], None]) -> None:
        self._on_change.append(fn)

    def set_source(self, source: str, specs: Iterable[EndpointSpec]) -> None:
        """Replaces what `source` contributes; endpoints join and leave live."""
        self._sources[source] = {s.address: s for s in specs}
        wanted: dict[str, EndpointSpec] = {}
        for owned in self._sources.values():
            wanted.update(owned)
        changed = self.generation == 0
        for addr in [a for a in self._endpoints if a not in wanted]:
            del self._endpoints[addr]
            changed = True
            for fn in self._on_remove:
                fn(addr)
        for addr, spec in wanted.items():
            ep = self._endpoints.get(addr)
            if ep is None:
                ep = self._endpoints[addr] = Endpoint(addr, spec.role)
                changed = True
            elif (ep.kv_events, ep.kv_replay, ep.dp_rank) != (spec.kv_events, spec.kv_replay,
                                                            spec.dp_rank):
                changed = True  # the KV-event subscriptions follow
            ep.role, ep.pool = spec.role, spec.pool
            ep.kv_events, ep.kv_replay, ep.dp_rank = spec.kv_events, spec.kv_replay, spec.dp_rank
        if changed:
            self.generation += 1
            for fn in self._on_change:
                fn()

    def all(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def __len__(self) -> int:
        return len(self._endpoints)

    def ready(self, now: float | None = None) -> bool:
        """Known endpoints, at least one of them up with current metrics."""
        now = time.monotonic() if now is None else now
        return any(not e.down and e.current(now, self.stale_after)
                   for e in self._endpoints.values())
