"""SLO admission: wraps the EPP's admission (flow control, or shedding alone).

A request with SLO headers is scheduled through the inner admission as usual, with
the cycle flag that lets the latency scorer shed it: a sheddable request (priority
< 0) that no candidate is predicted to serve within its SLO is refused with 429 and
`x-gateway-request-dropped-reason: rejected-slo-unattainable` before anything is
recorded for it. Other requests go to the endpoint predicted least late, or wait in
flow control's saturation queue when the pool is saturated (the inner admission's
choice). Requests without SLO headers pass through untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..admission import Admission, Held, Schedule
from ..scheduling.scorers.latency import SHED_UNATTAINABLE
from ..scheduling.types import Decision, SchedRequest
from .headers import FACTS


@dataclass(slots=True)
class SloAdmission:
    inner: Admission

    def admit(self, req: SchedRequest, headers: Mapping[str, str], nbytes: int | None,
              schedule: Schedule) -> Decision | Held:
        facts = req.cycle.read(FACTS)
        if facts is None or facts.slo is None or req.priority >= 0:
            return self.inner.admit(req, headers, nbytes, schedule)
        # Only while admitting: a request flow control queued is released later from
        # the queue's own loop, which must not raise; it then goes least late.
        req.cycle.write(SHED_UNATTAINABLE, True)
        try:
            return self.inner.admit(req, headers, nbytes, schedule)
        finally:
            req.cycle.write(SHED_UNATTAINABLE, False)
