"""Running the app until SIGTERM/SIGINT, then draining.

Kubernetes sends SIGTERM and waits `terminationGracePeriodSeconds`; we stop
accepting connections at once, give in-flight requests `shutdown_timeout`
seconds, cancel what is left (which aborts it in the engine), then stop the
engine. A second signal is not special-cased: the drain is already bounded.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Sequence

from aiohttp import web

from .app import build_app
from .body import DEFAULT_MAX_BODY_BYTES
from .state import get_state

log = logging.getLogger("kvyard.server")


async def serve(engine: Any, *, host: str, port: int, advertise: str,
                served_names: list[str] | None = None, role: str = "both",
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_timeout: float = 30.0,
                stop: asyncio.Event | None = None,
                extra_collectors: Sequence[Any] = (), pd: Any = None,
                enable_sleep_mode: bool = False, kv_events: Any = None) -> int:
    """Serves until a signal (or `stop`, for embedding) arrives; returns the exit code."""
    app = build_app(engine, advertise=advertise, served_names=served_names, role=role,
                    max_body_bytes=max_body_bytes, extra_collectors=extra_collectors, pd=pd,
                    enable_sleep_mode=enable_sleep_mode, kv_events=kv_events)
    # handler_cancellation: a dropped connection cancels its handler, which aborts the request.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           access_log=None)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()  # starts the engine (on_startup)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        st = get_state(app)
        peer = st.pd.peer if st.pd is not None else None
        log.info("serving %s on http://%s:%d (advertised as %s, role %s%s)",
                 ", ".join(st.served_names), host, port, advertise, role,
                 f", KV peer port {peer.port}" if peer is not None else "")
        await stop.wait()
        log.info("shutting down: draining in-flight requests (up to %.0fs)", shutdown_timeout)
    finally:
        await runner.cleanup()  # stops listening, drains, then stops the engine (on_cleanup)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("stopped")
    return 0

