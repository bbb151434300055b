"""Flow control: the admission (`admission.Admission`) that holds requests the pool
cannot take yet, instead of dropping them.

Two places a request can wait, both bounded (`config.FlowConfig`):

* the **waiting room**: the pool has no ready endpoint (scaled to zero, all
  asleep, all down). The request is parked, the scaler is told at once
  (`Demand.notify`, which wakes KEDA's `StreamIsActive`), and every parked
  request is dispatched, in priority then arrival order, the moment an
  endpoint is ready: on the discovery change or the first good scrape of it,
  not at a poll. Waiting-room requests are not held back by saturation: they
  were admitted when they arrived, and the new pods' own queues take them.
  TTL `noEndpointRequestTTL` (a cold start: long), then 503
  `rejected-no-endpoints` with `retry-after`.
* the **saturation queue**: every ready endpoint is saturated (`saturation.py`,
  from the scraped queues and KV use alone: a burst of our own picks is the
  workers' to batch, not ours to delay) and the request is not sheddable. Per-priority bands, highest first; inside a band,
  round-robin over fairness ids (`x-llm-d-inference-fairness-id`), FIFO per
  id. Dispatched as scrapes show room again. TTL `defaultRequestTTL`, then 429
  `rejected-ttl-expired`. Sheddable requests (priority < 0) are never queued
  for saturation: 429 `rejected-saturated`, as before.

"Ready" means a candidate of the primary profile (healthy, not asleep, of a
serving role) that a scrape has confirmed: an endpoint discovery just listed
is scraped at once, and requests wait the few ms for it rather than race its
start. A full queue (requests or bytes, global or the band's) answers 429
`rejected-queue-full`. A request's `x-kvyard-queue-ttl-ms` can shorten its
TTL. Clients that go away leave the queue at once (their ext_proc stream is
cancelled). On shutdown every held request gets 503 `rejected-shutting-down`
instead of a broken stream. Requests without a body (`GET /v1/models`) are
never held: metadata calls should not wake a GPU pool. A request the P/D
decider would have disaggregated but found no prefill pod for is not held
either (its decode pod prefills it) but wakes the prefill role's scaler.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping

from kvyard.common.wire import FAIRNESS_HEADER, QUEUE_TTL_HEADER

from ..admission import Held, Schedule, SheddingAdmission
from ..pool.endpoints import Endpoint, EndpointPool
from ..request import no_endpoint_in_time, queue_full, shed, shutting_down, ttl_expired
from ..saturation import pod_saturation, pool_saturation
from ..scheduling.cycle import PREFILL_MISSED
from ..scheduling.scheduler import Scheduler
from ..scheduling.types import Decision, SchedRequest
from .config import FlowConfig
from .demand import Demand
from .metrics import FlowMetrics
from .queues import BandQueue, Waiter

WAITING_ROOM, SATURATED = "waiting_room", "saturated"
ROLE = "decode"  # what every held request waits for (`demand.py`): a serving endpoint
PREFILL = "prefill"


@dataclass(slots=True)
class FlowController:
    cfg: FlowConfig
    pool: EndpointPool
    scheduler: Scheduler
    demand: Demand
    metrics: FlowMetrics
    room: list[Waiter] = field(default_factory=list)        # priority desc, then arrival
    bands: dict[int, BandQueue] = field(default_factory=dict)
    count: int = 0
    nbytes: int = 0
    band_count: dict[int, int] = field(default_factory=dict)
    band_bytes: dict[int, int] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    closed: bool = False
    # Requests without a body (GET /v1/models) are never held: metadata calls should not
    # wake a GPU pool. They get plain shedding, as with flow control off.
    bodyless: SheddingAdmission = field(init=False)

    def __post_init__(self) -> None:
        self.bodyless = SheddingAdmission(self.pool, self.scheduler)

    # ---- arrival --------------------------------------------------------------
    def admit(self, req: SchedRequest, headers: Mapping[str, str], nbytes: int | None,
              schedule: Schedule) -> Decision | Held:
        """A decision if the request can go now, else its place in a queue (Held)."""
        if nbytes is None:
            return self.bodyless.admit(req, headers, None, schedule)
        if self.room:
            self.release()  # an endpoint may be ready since the last release
        ready = self.ready_candidates(req)
        stage = WAITING_ROOM
        if ready:
            if req.priority < 0 and pool_saturation(ready) >= 1.0:
                self.metrics.outcome("shed")
                raise shed()
            if (self.cfg.queue_when_saturated and _full(ready)) or self.bands:
                stage = SATURATED  # nobody overtakes the requests already queued
            else:
                d = self._schedule(req, schedule)
                if d is not None:
                    return d
        w = self.enqueue(req, stage, nbytes, headers, schedule)
        return Held(self.remaining_s(w), partial(self.wait, w))

    def _schedule(self, req: SchedRequest, schedule: Schedule) -> Decision | None:
        d = schedule(req)
        if d is not None and req.cycle.read(PREFILL_MISSED):
            self.demand.notify(PREFILL)  # served decode-only; wake the prefill pool
        return d

    def enqueue(self, req: SchedRequest, stage: str, nbytes: int, headers: Mapping[str, str],
                schedule: Schedule) -> Waiter:
        """Hold the request (429 if the queue is full); await `wait(w)` for its decision."""
        if self.closed:
            raise shutting_down()
        band = self.cfg.band(req.priority)
        if (self.count >= self.cfg.max_requests or self.nbytes + nbytes > self.cfg.max_bytes
                or self.band_count.get(req.priority, 0) >= band.max_requests
                or self.band_bytes.get(req.priority, 0) + nbytes > band.max_bytes):
            self.metrics.outcome("queue_full")
            raise queue_full()
        w = Waiter(req, headers.get(FAIRNESS_HEADER, ""), nbytes, stage,
                   _ttl_cap(headers.get(QUEUE_TTL_HEADER)), self.clock(),
                   asyncio.get_running_loop().create_future(), schedule)
        p = req.priority
        self.count += 1
        self.nbytes += nbytes
        self.band_count[p] = self.band_count.get(p, 0) + 1
        self.band_bytes[p] = self.band_bytes.get(p, 0) + nbytes
        self._link(w, stage)
        if stage == SATURATED:
            self.release()
        return w

    async def wait(self, w: Waiter) -> Decision:
        try:
            return await w.future
        finally:
            if not w.future.done() or w.future.cancelled():  # the client went away
                self._drop(w, "cancelled")

    def remaining_s(self, w: Waiter) -> float:
        return max(0.0, w.deadline - self.clock())

    # ---- release --------------------------------------------------------------
    def ready_candidates(self, req: SchedRequest) -> list[Endpoint]:
        return [e for e in self.scheduler.candidates(req, self.pool.all())
                if e.last_ok > 0.0 and not e.down]

    def release(self) -> None:
        """Dispatch what the pool can take now (on discovery changes, scrapes, arrivals)."""
        if not self.count:
            return
        while self.room:
            w = self.room[0]
            if not self.ready_candidates(w.req) or not self._dispatch(w):
                return
        for prio in sorted(self.bands, reverse=True):
            band = self.bands[prio]
            while (w := band.head()) is not None:
                ready = self.ready_candidates(w.req)
                if not ready:
                    self._all_to_waiting_room()
                    return
                if _full(ready) or not self._dispatch(w):
                    return  # strict priority: lower bands wait behind this one

    def _dispatch(self, w: Waiter) -> bool:
        d = self._schedule(w.req, w.schedule)
        if d is None:
            return False
        self._drop(w, "dispatched")
        w.future.set_result(d)
        return True

    # ---- bookkeeping ----------------------------------------------------------
    def _link(self, w: Waiter, stage: str) -> None:
        """Into `stage`'s queue, with that stage's TTL from now."""
        w.stage = stage
        ttl = self.cfg.no_endpoint_ttl_s if stage == WAITING_ROOM else self.cfg.default_ttl_s
        if w.ttl_cap_s is not None:
            ttl = min(ttl, w.ttl_cap_s)
        w.deadline = self.clock() + ttl
        w.timer = asyncio.get_running_loop().call_later(ttl, self._expire, w)
        p = w.req.priority
        if stage == WAITING_ROOM:
            i = len(self.room)
            while i > 0 and self.room[i - 1].req.priority < p:
                i -= 1
            self.room.insert(i, w)
            self.demand.parked[ROLE] += 1
            self.demand.parked_bytes[ROLE] += w.nbytes
        else:
            self.bands.setdefault(p, BandQueue()).push(w)
            self.demand.queued[ROLE] += 1
            self.demand.queued_bytes[ROLE] += w.nbytes
        self.metrics.held(p, stage, 1, w.nbytes)
        if stage == WAITING_ROOM:
            self.demand.notify(ROLE)

    def _unlink(self, w: Waiter) -> bool:
        """Out of its stage's queue; False if it was in none (already gone)."""
        p = w.req.priority
        if w.stage == WAITING_ROOM:
            if w not in self.room:
                return False
            self.room.remove(w)
            self.demand.parked[ROLE] -= 1
            self.demand.parked_bytes[ROLE] -= w.nbytes
        else:
            band = self.bands.get(p)
            if band is None or w not in band.flows.get(w.flow, ()):
                return False
            band.remove(w)
            if not band.flows:
                del self.bands[p]
            self.demand.queued[ROLE] -= 1
            self.demand.queued_bytes[ROLE] -= w.nbytes
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        self.metrics.held(p, w.stage, -1, -w.nbytes)
        return True

    def _drop(self, w: Waiter, outcome: str) -> None:
        """The request leaves flow control (`outcome` labels the count); idempotent."""
        if not self._unlink(w):
            return
        p = w.req.priority
        self.count -= 1
        self.nbytes -= w.nbytes
        self.band_count[p] -= 1
        self.band_bytes[p] -= w.nbytes
        self.metrics.outcome(outcome)
        self.metrics.waited(w.stage, self.clock() - w.enqueued)

    def _all_to_waiting_room(self) -> None:
        """The pool emptied under the saturation queue: its requests now wait for a cold
        start, under that TTL (restarted, as llm-d restarts it when the pool flips)."""
        moved = [w for p in sorted(self.bands, reverse=True)
                 for q in self.bands[p].flows.values() for w in q]
        for w in moved:
            self._unlink(w)
            self._link(w, WAITING_ROOM)

    def _expire(self, w: Waiter) -> None:
        w.timer = None
        if w.future.done():
            return
        stage = w.stage
        self._drop(w, "expired")
        w.future.set_exception(no_endpoint_in_time() if stage == WAITING_ROOM else ttl_expired())

    def close(self) -> None:
        """Shutdown: every held request gets a clean 503 rather than a broken stream."""
        self.closed = True
        held = list(self.room) + [w for b in self.bands.values() for q in b.flows.values()
                                  for w in q]
        for w in held:
            self._drop(w, "shutdown")
            if not w.future.done():
                w.future.set_exception(shutting_down())

    def snapshot(self) -> dict:
        return {"parked": len(self.room),
                "queued": self.count - len(self.room), "bytes": self.nbytes,
                "oldest_wait_s": round(max((self.clock() - w.enqueued for w in self.room),
                                           default=0.0), 3)}


def _full(ready: list[Endpoint]) -> bool:
    """No endpoint has room: every one is saturated by its scraped queue or KV use. (The
    pool's mean, which sheds, would hold everything behind one deeply queued pod.)"""
    return min(pod_saturation(e, picks=False) for e in ready) >= 1.0


def _ttl_cap(raw: str | None) -> float | None:
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        return None
    return max(ms, 0.0) / 1000.0 if ms == ms else None  # NaN: ignored
