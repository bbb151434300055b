"""Admission: whether, and when, an admitted request is scheduled.

`Director.handle` gives each parsed request to one `Admission`. It answers
with a `Decision` (it let the request through and scheduled it now, with the
`schedule` step the director passes in), a `Held` (the request waits; the
admission schedules it when it releases it) or raises a `Rejection` (429
shed, queue full, 503 no endpoint, ...). Two implementations:

* `SheddingAdmission` (here): sheddable requests (priority < 0) get 429 while
  the pool is saturated (`saturation.py`); everything else is scheduled at
  once, and a request with no endpoint gets 503. `kvyard epp
  --no-flow-control` runs it alone.
* `flow.controller.FlowController`: also holds what the pool cannot take yet
  (the saturation queue, the waiting room); the default.

The next admissions (SLO-aware admission with a latency predictor) implement
the same protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Protocol

from .pool.endpoints import EndpointPool
from .request import no_endpoint, shed
from .saturation import pool_saturation
from .scheduling.scheduler import Scheduler
from .scheduling.types import Decision, SchedRequest

# The director's scheduling step: a Decision, or None when no endpoint fits.
Schedule = Callable[[SchedRequest], "Decision | None"]


@dataclass(slots=True)
class Held:
    """A request admission holds. The server tells Envoy to wait up to
    `remaining_s` (the request's TTL), then awaits `wait()`: its Decision once
    released, or the Rejection it ended with (raised)."""

    remaining_s: float
    wait: Callable[[], Awaitable[Decision]]


class Admission(Protocol):
    def admit(self, req: SchedRequest, headers: Mapping[str, str], nbytes: int | None,
              schedule: Schedule) -> Decision | Held:
        """`nbytes`: the body's size; None for a request without a body (never held)."""
        ...


@dataclass(slots=True)
class SheddingAdmission:
    pool: EndpointPool
    scheduler: Scheduler

    def admit(self, req: SchedRequest, headers: Mapping[str, str], nbytes: int | None,
              schedule: Schedule) -> Decision:
        if req.priority < 0:
            cands = self.scheduler.candidates(req, self.pool.all())
            if cands and pool_saturation(cands) >= 1.0:
                raise shed()
        d = schedule(req)
        if d is None:
            raise no_endpoint()
        return d
