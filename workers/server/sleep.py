"""Sleep mode's HTTP side, vLLM's routes (`kvyard worker --enable-sleep-mode`).

- `POST /sleep?level=1|2` (default 1): level 1 moves the weights to pinned host
  memory (on CPU they stay in host memory) and drops the KV cache; level 2 drops
  both (waking reloads the weights from the model source). Answers 200 once the
  engine sleeps; a level other than 1 or 2 is a 400.
- `POST /wake_up`: restores (level 1: copies the weights back, re-allocates the
  KV cache; level 2: reloads; on CUDA the captured graphs stay valid: engine/sleep_arena.py).
  200 once serving again.
- `GET /is_sleeping` -> `{"is_sleeping": bool}`.
Without the flag the routes do not exist (404), as in vLLM, whose dev routes
are only registered when sleep mode is on.

Requests in flight when /sleep arrives are drained, not aborted: from that
moment new generation requests are refused, the ones already in the engine run
to their end, and the engine sleeps when it holds none (the /sleep response
waits for that). While draining, asleep, or waking, a completion or chat
request gets a 503 at once, OpenAI-shaped, code "model_sleeping", with
`Retry-After`, never a queued wait. /health stays 200 (vLLM's /health is 200
while sleeping: the pod is alive and must not be restarted) with
`"status": "sleeping", "sleeping": true, "level": n`; the EPP reads the gauge
`kvyard:sleeping` (1 while draining, asleep or waking) and sends it no traffic.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric

from kvyard.common import wire
from kvyard.common.api import error_body

log = logging.getLogger("kvyard.server")

RETRY_AFTER_S = 5


@dataclass(slots=True)
class SleepGate:
    """What the server knows: whether it refuses generation, and at which level it sleeps."""

    engine: Any
    refusing: bool = False     # from /sleep's arrival until /wake_up completes
    level: int = 0             # the level it sleeps at once asleep; 0 awake
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def sleeping(self) -> bool:
        return self.level != 0


SLEEP: web.AppKey[SleepGate] = web.AppKey("kvyard_sleep", SleepGate)


def gate(app: web.Application) -> SleepGate | None:
    return app.get(SLEEP)


def refusal() -> web.Response:
    """The answer to a generation request while the model sleeps."""
    body = error_body(503, "the model is sleeping (sleep mode); wake it with POST /wake_up",
                      "model_sleeping")
    return web.json_response(body, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def health_fields(app: web.Application) -> dict[str, Any]:
    g = gate(app)
    if g is None or not (g.refusing or g.sleeping):
        return {}
    return {"status": "sleeping", "sleeping": True, "level": g.level or None}


class _SleepCollector:
    def __init__(self, g: SleepGate, model_name: str) -> None:
        self._g, self._model = g, model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = GaugeMetricFamily(wire.M_SLEEPING, "1 while the model sleeps (or drains or wakes): "
                              "no traffic.", labels=["model_name"])
        m.add_metric([self._model], 1.0 if (self._g.refusing or self._g.sleeping) else 0.0)
        yield m


def _level(request: web.Request) -> int:
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise web.HTTPBadRequest(text=f"level must be 1 or 2, not {raw!r}")
    return int(raw)


async def _sleep(request: web.Request) -> web.Response:
    g = request.app[SLEEP]
    level = _level(request)
    # shielded: a client that goes away mid-drain must not leave the gate half-set
    await asyncio.shield(asyncio.ensure_future(_go_to_sleep(g, level)))
    return web.json_response({"is_sleeping": True, "level": g.level})


async def _go_to_sleep(g: SleepGate, level: int) -> None:
    async with g.lock:
        if g.level >= level:
            return
        g.refusing = True
        t0 = time.perf_counter()
        try:
            await g.engine.sleep(level)
        except BaseException:
            g.refusing = g.sleeping   # still awake: serve again
            raise
        g.level = level
    log.info("asleep at level %d (%.3fs)", level, time.perf_counter() - t0)


async def _go_awake(g: SleepGate) -> None:
    async with g.lock:
        if g.sleeping:
            t0 = time.perf_counter()
            await g.engine.wake_up()
            log.info("awake after level %d sleep (%.3fs)", g.level, time.perf_counter() - t0)
        g.level = 0
        g.refusing = False


async def _wake_up(request: web.Request) -> web.Response:
    await asyncio.shield(asyncio.ensure_future(_go_awake(request.app[SLEEP])))
    return web.json_response({"is_sleeping": False})


async def _is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[SLEEP].sleeping})


def install(app: web.Application, engine: Any, registry: Any, model_name: str) -> SleepGate:
    """Adds the routes and the gauge; `engine` has `sleep(level)` and `wake_up()`."""
    g = SleepGate(engine)
    app[SLEEP] = g
    registry.register(_SleepCollector(g, model_name))
    app.router.add_post("/sleep", _sleep)
    app.router.add_post("/wake_up", _wake_up)
    app.router.add_get("/is_sleeping", _is_sleeping)
    return g
