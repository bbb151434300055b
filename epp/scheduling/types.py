"""The values scheduling passes around: the request as plugins see it, each
profile's result, and the decision the EPP answers with."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..pool.endpoints import Endpoint
from ..prompt import LazyPrompt
from .cycle import CycleState


@dataclass(slots=True)
class SchedRequest:
    model: str
    prompt: LazyPrompt  # chained block hashes of the prompt, computed on demand
    priority: int = 0
    now: float = 0.0  # monotonic time of the decision
    stale_after: float = 2.0
    cycle: CycleState = field(default_factory=CycleState)  # this request's shared plugin state
    adapter: str = ""  # the LoRA adapter `model` names (epp/models.py); "": a base model
    pool: str = ""     # the pool serving `model` (epp/models.py); "": every endpoint


@dataclass(slots=True)
class ProfileResult:
    endpoints: list[Endpoint]  # the pick first, then fallbacks
    score: float               # the pick's total score
    candidates: int            # endpoints left after the filters


@dataclass(slots=True)
class SchedulingResult:
    results: dict[str, ProfileResult]
    primary: str  # the profile whose pick is the request's destination


@dataclass(slots=True)
class Decision:
    endpoint: Endpoint
    score: float
    matched_blocks: int
    total_blocks: int  # estimated until the prompt is fully hashed
    candidates: int
    prompt: LazyPrompt | None = None
    fallbacks: list[Endpoint] = field(default_factory=list)
    result: SchedulingResult | None = None
    prefill: Endpoint | None = None  # P/D: the pod that prefills (x-prefiller-host-port)

    @property
    def destination(self) -> str:
        """`x-gateway-destination-endpoint`: the pick, then fallbacks, comma-separated."""
        if not self.fallbacks:
            return self.endpoint.address
        return ",".join([self.endpoint.address, *(e.address for e in self.fallbacks)])
