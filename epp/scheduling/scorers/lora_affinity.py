"""The lora-affinity scorer: endpoints that have the request's LoRA adapter active.

GAIE's semantics (its `lora-affinity-scorer`), from each endpoint's scraped
`vllm:lora_requests_info`: 1 where the adapter is active (a running or waiting request
uses it), `roomScore` (GAIE's 0.8) where it is not but a slot is free (fewer adapters in
use than `max_lora`), 0 where loading it would evict an adapter. A request for a base
model scores 1 everywhere (no preference).

Against thrash, what the metric cannot say: vLLM keeps an adapter loaded after its last
request ends (an LRU of `--max-loras` slots), while the metric lists only adapters in
use. So the scorer also keeps, per endpoint, the adapters it sent there most recently
(an LRU as long as the endpoint's `max_lora`): those count as active, and an endpoint
whose slots are all remembered has no room. A popular adapter stays on the pods that
have it; a rare one goes where a slot is free instead of evicting a busy one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ...pool.endpoints import Endpoint
from ..hooks import PoolListener, PreRequest, Scorer
from ..plugin_config import param
from ..types import SchedRequest


@dataclass(slots=True, frozen=True)
class LoraAffinityParams:
    roomScore: float = param(0.8, min=0.0, max=1.0,
                             doc="score of an endpoint without the adapter but with a free "
                                 "slot (GAIE's 0.8)")
    defaultMaxLoras: int = param(1, min=1, doc="slots assumed until an endpoint's metrics "
                                               "say (vLLM's --max-loras default)")


@dataclass(slots=True)
class LoraAffinityScorer(Scorer, PreRequest, PoolListener):
    """1: the adapter is active there (scraped, or among the adapters last sent there);
    roomScore: a free slot; 0: loading it evicts another. Base models: 1 everywhere."""

    room_score: float = 0.8
    default_max_loras: int = 1
    name: str = "lora-affinity"
    _sent: dict[str, OrderedDict[str, None]] = field(default_factory=dict)

    @classmethod
    def build(cls, p: LoraAffinityParams) -> "LoraAffinityScorer":
        return cls(p.roomScore, p.defaultMaxLoras)

    def _slots(self, e: Endpoint) -> int:
        return e.max_lora if e.max_lora else self.default_max_loras

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        a = req.adapter
        if not a:
            return [1.0] * len(eps)
        out: list[float] = []
        for e in eps:
            sent = self._sent.get(e.address, ())
            if a in e.lora_running or a in e.lora_waiting or a in sent:
                out.append(1.0)
                continue
            used = len(e.lora_running | e.lora_waiting | set(sent))
            out.append(self.room_score if used < self._slots(e) else 0.0)
        return out

    def pre_request(self, req: SchedRequest, ep: Endpoint) -> None:
        if not req.adapter:
            return
        lru = self._sent.setdefault(ep.address, OrderedDict())
        for busy in ep.lora_running:  # in use there, whoever sent it: keep it recent
            if busy in lru:
                lru.move_to_end(busy)
        lru[req.adapter] = None  # the pick's adapter is loaded there now: the most recent
        lru.move_to_end(req.adapter)
        while len(lru) > self._slots(ep):
            lru.popitem(last=False)

    def forget(self, address: str) -> None:
        self._sent.pop(address, None)
