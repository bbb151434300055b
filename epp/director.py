"""The director: one request's path through the EPP (GAIE/llm-d's director).

    handle:  parse (+ hash, lazily) → Admission.admit → Scheduler.schedule
             (profile handler, then the PreRequest hooks) → Decision
    after the answer: Finisher (hash the rest of the prompt, PostResponse hooks)

`handle` is synchronous and never waits: it returns the `Decision`, the
`Rejection` the request ended with, or a `Held` when admission keeps the
request (flow control's queues); `wait(held)` then gives its outcome. The
ext_proc server (`server.py`) calls exactly this object, and so does
`kvyard.bench.epp_api`, so the benchmark times what the server runs. Each
request gets its own cycle state (`SchedRequest.cycle`), shared by the
plugins that schedule it. Metrics: the decision's latency (until the
Decision; for a held request, from the hold message to its
release) and every rejection's reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .admission import Admission, Held
from .finisher import Finisher
from .models import ModelRoutes
from .observability import EppMetrics
from .pool.endpoints import EndpointPool
from .prompt import LazyPrompt, PromptHasher
from .request import Rejection, parse_request, priority_of
from .scheduling.scheduler import Scheduler
from .scheduling.types import Decision, SchedRequest

_EMPTY = LazyPrompt.of_hashes([])


def _address(ep) -> str:
    return ep.address


def stable_seed(req: SchedRequest) -> int:
    """The tie-break seed with replicas: the prompt's first block hash, the same on every
    replica, so ties of one prompt break alike while different prompts still spread."""
    first = req.prompt.get(0)
    return 0 if first is None else first


@dataclass(slots=True)
class Director:
    pool: EndpointPool
    scheduler: Scheduler
    hasher: PromptHasher
    admission: Admission
    metrics: EppMetrics
    finisher: Finisher
    served_models: list[str] = field(default_factory=list)
    # Active-active replicas (epp/replicas/): every pick is told to the peers, and ties
    # break by a stable order so replicas in the same state pick the same endpoint.
    on_pick: Callable[[SchedRequest, Decision], None] | None = None
    stable_ties: bool = False
    # Several models (models.py): `model` -> its pool; None: one pool, `served_models`.
    routes: ModelRoutes | None = None
    # Pools whose workers tokenize otherwise than `hasher` (models.py `tokenizer`): their own.
    pool_hashers: dict[str, PromptHasher] = field(default_factory=dict)
    # SLO routing (epp/slo/): the request's facts into its cycle state once parsed.
    on_parse: Callable[[SchedRequest, Mapping[str, str], object], None] | None = None

    def parse(self, headers: Mapping[str, str], body: bytes | None) -> SchedRequest:
        """Parse and hash (lazily): the request as scheduling sees it; Rejection if bad."""
        now = time.monotonic()
        if body is None:  # no body (GET /v1/models …): any healthy endpoint
            return SchedRequest("", _EMPTY, priority_of(headers, self.scheduler.objectives),
                                now, self.pool.stale_after)
        parsed = parse_request(body, headers.get(":path", "/"), headers, self.served_models,
                               self.scheduler.objectives)
        route = self.routes.get(parsed.model) if self.routes is not None else None
        hasher = self.pool_hashers.get(route.pool, self.hasher) if route else self.hasher
        req = SchedRequest(parsed.model, hasher.prompt(parsed), parsed.priority, now,
                           self.pool.stale_after)
        if route is not None:
            req.pool, req.adapter = route.pool, route.name if route.parent else ""
        if self.on_parse is not None:
            self.on_parse(req, headers, parsed)
        return req

    def candidates(self, req: SchedRequest) -> list:
        """The endpoints that may serve `req`: its pool's and the unlabelled ones."""
        eps = self.pool.all()
        if req.pool:
            eps = [e for e in eps if not e.pool or e.pool == req.pool]
        return eps

    def schedule(self, req: SchedRequest) -> Decision | None:
        """The scheduling step admission runs, now or when it releases the request."""
        if not self.stable_ties:
            d = self.scheduler.schedule(req, self.candidates(req))
        else:
            self.scheduler.rng.seed(stable_seed(req))
            d = self.scheduler.schedule(req, sorted(self.candidates(req), key=_address))
        if d is not None and self.on_pick is not None:
            self.on_pick(req, d)
        return d

    def handle(self, headers: Mapping[str, str], body: bytes | None) -> Decision | Held | Rejection:
        t0 = time.perf_counter()
        if body is None and self.routes is not None and \
                headers.get(":path", "").split("?", 1)[0] == "/v1/models":
            return self.routes.listing()  # every pool's models, not one endpoint's
        try:
            req = self.parse(headers, body)
            out = self.admission.admit(req, headers, None if body is None else len(body),
                                       self.schedule)
        except Rejection as r:
            self.metrics.error(r.reason)
            return r
        if type(out) is Decision:
            self.metrics.decision(time.perf_counter() - t0, out)
        return out

    async def wait(self, held: Held) -> Decision | Rejection:
        """A held request's outcome, once admission releases or drops it."""
        t0 = time.perf_counter()
        try:
            d = await held.wait()
        except Rejection as r:
            self.metrics.error(r.reason)
            return r
        self.metrics.decision(time.perf_counter() - t0, d)
        return d

    async def settle(self) -> None:
        """Before deciding: let teaching still in flight land (`Finisher.settle`)."""
        await self.finisher.settle()

    def finish(self, d: Decision) -> None:
        """After deciding, before Envoy has the answer: the post-response work is queued."""
        self.finisher.submit(d)
