"""The director: one request's lifecycle in the EPP.

    parse + hash → admission (flow control: shed, queue, or park in the
    waiting room) → scheduling (profile handler, pre-request hooks) → the
    answer's headers → post-response (teaching)

`Router.route` is the synchronous CPU part, so `bench_api` can time exactly
what the ext_proc server runs; `Finisher` is the post-response part, which
can wait until Envoy has its answer. Each request gets its own cycle state
(`SchedRequest.cycle`), shared by the plugins that schedule it. Admission
here is saturation shedding alone (`route`, never waits); the ext_proc
server runs `prepare`, then flow control (`flow_control.py`), which can hold
a request and schedules it when it is released.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvyard.common.wire import DROPPED_REASON_HEADER

from .pool.endpoints import Endpoint, EndpointPool
from .prompt import LazyPrompt, PromptHasher
from .request import RequestError, parse_request, priority_of
from .saturation import pool_saturation
from .scheduling.plugins import SchedRequest
from .scheduling.scheduler import Decision, Scheduler

_EMPTY = LazyPrompt.of_hashes([])


@dataclass(slots=True)
class Router:
    pool: EndpointPool
    scheduler: Scheduler
    hasher: PromptHasher
    served_models: list[str] = field(default_factory=list)

    def prepare(self, headers: dict[str, str], body: bytes | None) -> SchedRequest:
        """Parse and hash (lazily): the request as scheduling sees it; RequestError if bad."""
        now = time.monotonic()
        if body is None:  # no body (GET /v1/models …): any healthy endpoint
            return SchedRequest("", _EMPTY, priority_of(headers, self.scheduler.objectives),
                                now, self.pool.stale_after)
        parsed = parse_request(body, headers.get(":path", "/"), headers, self.served_models,
                               self.scheduler.objectives)
        return SchedRequest(parsed.model, self.hasher.prompt(parsed), parsed.priority, now,
                            self.pool.stale_after)

    def route(self, headers: dict[str, str], body: bytes | None) -> Decision:
        """The chosen endpoint now, never held (flow control's holding is the ext_proc
        server's, `flow_control.py`); raises RequestError for 4xx/5xx answers."""
        return self.decide(self.prepare(headers, body))

    def decide(self, req: SchedRequest) -> Decision:
        eps = self.pool.all()
        self.admit(req, eps)
        decision = self.scheduler.schedule(req, eps)
        if decision is None:
            raise RequestError(503, "no ready endpoint for this request", "no_endpoint",
                               code="rejected-no-endpoints",
                               headers=((DROPPED_REASON_HEADER, "rejected-no-endpoints"),
                                        ("retry-after", "1")))
        return decision

    def admit(self, req: SchedRequest, eps: list[Endpoint]) -> None:
        """Admission: sheddable requests (priority < 0) get 429 while the pool is saturated."""
        if req.priority < 0:
            cands = self.scheduler.candidates(req, eps)
            if cands and pool_saturation(cands) >= 1.0:
                raise RequestError(429, "the pool is saturated; sheddable request dropped",
                                   "shed", code="rejected-saturated",
                                   headers=((DROPPED_REASON_HEADER, "rejected-saturated"),))


@dataclass(slots=True)
class Finisher:
    """Hashes the rest of a routed prompt in a worker thread (the Rust
    tokenizer releases the GIL) and teaches the prefix index on the loop.

    The backlog is bounded: under overload we skip teaching (the index then
    knows only the prefix hashed during the decision) rather than queue work
    without limit. `settle()` lets the next decision wait (briefly) for
    teaching still in flight: otherwise a follow-up request that shares the
    prefix could be routed before the index knows where the prefix went,
    which broke stickiness on a loaded machine. The wait is normally a few
    ms (the rest of one prompt's hashing) and is capped.
    """

    pool: EndpointPool
    scheduler: Scheduler
    max_backlog: int = 256
    settle_timeout_s: float = 0.5
    backlog: int = 0
    skipped: int = 0
    _pending: set = field(default_factory=set)
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="epp-finish"))

    def submit(self, d: Decision) -> None:
        p = d.prompt
        if p is None or p.done:
            return
        if self.backlog >= self.max_backlog:
            self.skipped += 1
            return
        self.backlog += 1
        # P/D: the prefill pod computed the prompt's KV and the decode pod holds it after
        # the handoff, so both learn it.
        where = [d.endpoint.address] + ([d.prefill.address] if d.prefill is not None else [])
        task = asyncio.ensure_future(self._finish(where, p))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _finish(self, addresses: list[str], prompt: LazyPrompt) -> None:
        try:
            hashes = await asyncio.get_running_loop().run_in_executor(self._executor, prompt.finish)
        except Exception:  # noqa: BLE001 - teaching is best effort; routing already happened
            return
        finally:
            self.backlog -= 1
        for address in addresses:
            if self.pool.get(address) is not None:  # it may have left meanwhile
                self.scheduler.learn(address, hashes)

    async def settle(self) -> None:
        """Wait, at most `settle_timeout_s`, until earlier decisions are taught."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self.settle_timeout_s)

    def close(self) -> None:
        for t in self._pending:
            t.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
