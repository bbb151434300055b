"""One request's decision: parse, hash, shed, schedule. Synchronous and pure
CPU work, so `bench_api` can time exactly what the ext_proc server runs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvyard.common.wire import DROPPED_REASON_HEADER

from .endpoints import EndpointPool
from .plugins import SchedRequest
from .prompt import PromptHasher
from .request import RequestError, parse_request, priority_of
from .saturation import pool_saturation
from .scheduler import Decision, Scheduler


@dataclass(slots=True)
class Router:
    pool: EndpointPool
    scheduler: Scheduler
    hasher: PromptHasher
    served_models: list[str] = field(default_factory=list)

    def route(self, headers: dict[str, str], body: bytes | None) -> Decision:
        """The chosen endpoint; raises RequestError for 4xx/5xx answers."""
        now = time.monotonic()
        if body is None:  # no body (GET /v1/models …): any healthy endpoint
            req = SchedRequest("", [], priority_of(headers, self.scheduler.objectives), now,
                               self.pool.stale_after)
        else:
            parsed = parse_request(body, headers.get(":path", "/"), headers, self.served_models,
                                   self.scheduler.objectives)
            hashes, _ = self.hasher.hashes(parsed)
            req = SchedRequest(parsed.model, hashes, parsed.priority, now, self.pool.stale_after)
        eps = self.pool.all()
        if req.priority < 0:
            cands = self.scheduler.candidates(req, eps)
            if cands and pool_saturation(cands) >= 1.0:
                raise RequestError(429, "the pool is saturated; sheddable request dropped",
                                   "shed", err_type="rate_limit_error",
                                   headers=((DROPPED_REASON_HEADER, "saturated"),))
        decision = self.scheduler.schedule(req, eps)
        if decision is None:
            raise RequestError(503, "no ready endpoint for this request", "no_endpoint",
                               err_type="service_unavailable")
        return decision
