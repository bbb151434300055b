"""Which KV-event streams the EPP subscribes to: those of the endpoints it discovered,
and only those.

Where an endpoint publishes (decided here, in this order):

1. its discovery entry: in an endpoints file `kv_events: tcp://host:5557` (and
   `kv_events_replay: tcp://host:5558`, `data_parallel_rank: N`); in Kubernetes the
   pod annotations `kvyard.io/kv-events-port` / `kvyard.io/kv-events-replay-port`
   (`pool/discovery_k8s.py`), joined to the pod IP;
2. else the port convention `--kv-events-port P`: tcp://<endpoint host>:P, replay on
   P + 1 (vLLM's usual 5557/5558);
3. else none: the endpoint routes by the approximate scorer alone.

Workers do not report their publisher on `/health` (neither do stock vLLM pods), so
there is no fallback to it. Several endpoints naming one stream are a data-parallel
pod's ranks: one subscription, each batch to its rank's endpoint.

`sync()` runs on every pool change: new streams are subscribed, streams no endpoint
names any more are closed and their endpoints' blocks forgotten.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import zmq.asyncio

from ..pool.endpoints import Endpoint, EndpointPool
from .index import KVBlockIndex
from .subscriber import Subscription


def stream_of(ep: Endpoint, port: int | None) -> tuple[str, str | None] | None:
    """(PUB, replay) endpoints of `ep`'s KV events, or None."""
    if ep.kv_events:
        return ep.kv_events, ep.kv_replay
    if port is None:
        return None
    host = ep.address.rpartition(":")[0]
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


@dataclass(slots=True)
class KVEventSources:
    index: KVBlockIndex
    pool: EndpointPool
    port: int | None = None  # --kv-events-port: the convention for endpoints without one
    subs: dict[str, Subscription] = field(default_factory=dict)  # PUB endpoint -> subscription
    _ctx: zmq.asyncio.Context | None = None

    def sync(self) -> None:
        """Subscribes to every stream the pool names; drops the rest (call on the loop)."""
        wanted: dict[str, tuple[str | None, dict[int | None, str]]] = {}
        for ep in self.pool.all():
            s = stream_of(ep, self.port)
            if s is None:
                continue
            replay, ranks = wanted.setdefault(s[0], (s[1], {}))
            ranks[ep.dp_rank] = ep.address
        for url in [u for u in self.subs if u not in wanted or self.subs[u].replay
                    != wanted[u][0]]:
            self._drop(url)
        for url, (replay, ranks) in wanted.items():
            sub = self.subs.get(url)
            if sub is None:
                if self._ctx is None:
                    self._ctx = zmq.asyncio.Context()
                sub = self.subs[url] = Subscription(self._ctx, url, replay, self.index)
                sub.ranks = ranks
                sub.start()
                continue
            for addr in set(sub.ranks.values()) - set(ranks.values()):
                self.index.clear(addr)
            sub.ranks = ranks

    def _drop(self, url: str) -> None:
        sub = self.subs.pop(url)
        if sub.task is not None:
            sub.task.cancel()
        for addr in set(sub.ranks.values()):
            self.index.forget(addr)

    async def close(self) -> None:
        for sub in list(self.subs.values()):
            await sub.stop()
        self.subs.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def snapshot(self) -> dict:
        return {"index": self.index.snapshot(),
                "streams": [s.snapshot() for s in self.subs.values()]}
