"""What flow control holds: a held request (`Waiter`) and one priority's
saturation queue (`BandQueue`: round robin over fairness ids, FIFO within each)."""
from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..admission import Schedule
from ..scheduling.types import SchedRequest


@dataclass(slots=True, eq=False)
class Waiter:
    req: SchedRequest
    flow: str
    nbytes: int
    stage: str
    ttl_cap_s: float | None
    enqueued: float
    future: asyncio.Future
    schedule: Schedule  # the director's scheduling step, run when the request is released
    deadline: float = 0.0
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class BandQueue:
    """One priority's saturation queue: fairness ids in round-robin order, FIFO each."""

    flows: OrderedDict[str, deque[Waiter]] = field(default_factory=OrderedDict)

    def push(self, w: Waiter) -> None:
        self.flows.setdefault(w.flow, deque()).append(w)

    def head(self) -> Waiter | None:
        for q in self.flows.values():
            return q[0]
        return None

    def remove(self, w: Waiter) -> None:
        """Out of its flow; a flow whose head leaves goes to the back (round robin)."""
        q = self.flows.get(w.flow)
        if q is None or w not in q:
            return
        was_head = q[0] is w and next(iter(self.flows)) == w.flow
        q.remove(w)
        if not q:
            del self.flows[w.flow]
        elif was_head:
            self.flows.move_to_end(w.flow)
