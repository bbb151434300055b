"""`--start-delay`: a simulated pod's start time (a GPU pod pulling its image and loading
weights takes minutes; the spare's interpreter a second).

The pod binds its port at once but is not ready until `start_delay` simulated seconds
after its process began serving (wall: the delay / `--time-scale`; the tokenizer loads
meanwhile): until then /health answers 503 `{"status": "starting"}` (a readiness probe
fails), /metrics 503 (the EPP's scrape fails, so it routes nothing there) and every other
route an OpenAI-style 503, as a worker still loading its model would.
"""
from __future__ import annotations

import time

from aiohttp import web

from kvyard.common.api import error_json


def ready_at(start_delay_s: float, time_scale: float, now: float | None = None) -> float:
    """The monotonic time a pod started now becomes ready."""
    now = time.monotonic() if now is None else now
    return now + max(0.0, start_delay_s) / time_scale


def gate(pod_of):
    """An aiohttp middleware answering 503 until the pod (`pod_of(request)`) is ready."""

    @web.middleware
    async def starting(request: web.Request, handler):
        pod = pod_of(request)
        left = pod.ready_at - time.monotonic()
        if left <= 0:
            return await handler(request)
        if request.path == "/health":
            return web.json_response({"status": "starting", "ready_in_s": round(left, 3)},
                                     status=503, headers=pod.headers)
        return web.Response(status=503, body=error_json(
            503, f"the pod is starting (ready in {left:.1f}s wall)", "starting"),
            content_type="application/json", headers=pod.headers)

    return starting
