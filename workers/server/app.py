"""The worker's aiohttp application: routes, the endpoint header, engine lifecycle.

`build_app` takes an already constructed engine so loading the model (slow,
blocking) happens before the event loop serves anything, and so tests or
other components can wrap any engine with the same HTTP surface.
"""
from __future__ import annotations

from typing import Any, Sequence

from aiohttp import web

from kvyard.common import wire

from .body import DEFAULT_MAX_BODY_BYTES
from .errors import error_middleware
from .generate import chat_completions, completions, detokenize, tokenize
from kvyard.workers.pd.metrics import PDMetrics, worker_info

from . import lora_routes, sleep
from .metrics import CONTENT_TYPE, ServerMetrics
from .state import STATE, ServerState, get_state


def max_token_chars(tokenizer: Any) -> int | None:
    """The most input characters one token can stand for: its vocabulary's longest entry
    (byte-level entries are one character per byte, so never fewer than they decode to),
    times 4 when a normalizer may shrink the text first (NFC composes up to ~3 code
    points into one). None when the tokenizer does not say: no cheap bound then."""
    backend = getattr(tokenizer, "backend", None)
    try:
        vocab = backend.get_vocab(with_added_tokens=True)
    except AttributeError:
        return None
    longest = max(map(len, vocab), default=0)
    if not longest:
        return None
    return longest * (4 if getattr(backend, "normalizer", None) is not None else 1)


async def _health(request: web.Request) -> web.Response:
    """Liveness and readiness: the server only listens once the engine has started,
    and a dead engine thread turns this into 503 so Kubernetes restarts the pod
    (and the EPP, seeing scrapes succeed but health fail, is not the only judge)."""
    state = get_state(request.app)
    if getattr(state.engine, "is_running", True) is False:
        return web.json_response({"status": "engine stopped", "role": state.role}, status=503)
    # asleep: still 200, as vLLM (alive, not to be restarted), and the body says so
    peer = state.pd.peer_info() if state.pd is not None else None
    return web.json_response({"status": "ok", "role": state.role, "sleeping": False,
                              **sleep.health_fields(request.app),
                              **({"kv_peer": peer} if peer else {})})


def _awake_only(handler):
    """Generation while the model sleeps (or drains, or wakes) is a 503 at once (sleep.py)."""
    async def guarded(request: web.Request) -> web.StreamResponse:
        g = sleep.gate(request.app)
        if g is not None and (g.refusing or g.sleeping):
            return sleep.refusal()
        return await handler(request)

    return guarded


async def _version(request: web.Request) -> web.Response:
    """vLLM's `/version` (dashboards and probes ask it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("kvyard")
    except PackageNotFoundError:
        v = "unknown"
    return web.json_response({"version": v})


async def _metrics(request: web.Request) -> web.Response:
    body = get_state(request.app).metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _stamp_endpoint(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, errors and streams included, names the worker that produced it."""
    response.headers[wire.ENDPOINT_HEADER] = get_state(request.app).advertise


def build_app(engine: Any, *, advertise: str, served_names: list[str] | None = None,
              role: str = "both", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              manage_engine: bool = True, extra_collectors: Sequence[Any] = (),
              pd: Any = None, enable_sleep_mode: bool = False,
              kv_events: Any = None) -> web.Application:
    """An app serving `engine`; with `manage_engine` the app starts and shuts it down.

    `extra_collectors` (e.g. the kvstore connector's) join this app's /metrics.
    `pd`: P/D options (kvyard.workers.pd.runtime.PDOptions); its runtime starts
    with the engine (it needs the bound KV cache). `enable_sleep_mode`: vLLM's sleep
    routes (sleep.py). `kv_events`: a kvyard.common.kv_events.KVEventsConfig; when
    active, the block manager's events are published (kv_events.py)."""
    names = list(served_names or [engine.served_model_name])
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    state = ServerState(
        engine=engine, served_names=names, advertise=advertise, role=role,
        metrics=ServerMetrics(engine.stats, names[0]),
        vocab_size=getattr(engine.tokenizer, "vocab_size", None),
        max_token_chars=max_token_chars(engine.tokenizer))
    for collector in extra_collectors:
        state.metrics.register_extra(collector)
    worker_info(state.metrics.registry, role)
    runtime = None
    if pd is not None:
        from kvyard.workers.pd.runtime import PDRuntime

        runtime = PDRuntime(pd, PDMetrics(state.metrics.registry, state.metrics.slow_registry))
    publisher = None
    if kv_events is not None and kv_events.active:
        from .kv_events import KVEventMetrics, KVEventPublisher

        publisher = KVEventPublisher(kv_events.with_default_topic(advertise, names[0]),
                                     KVEventMetrics(state.metrics.registry))
    app[STATE] = state
    app.on_response_prepare.append(_stamp_endpoint)
    app.router.add_get("/v1/models", lora_routes.models)
    lora_routes.install(app, engine)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    if enable_sleep_mode:
        sleep.install(app, engine, state.metrics.registry, names[0])
    app.router.add_post("/v1/completions", _awake_only(completions))
    app.router.add_post("/v1/chat/completions", _awake_only(chat_completions))
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", _version)
    if manage_engine:
        async def start(_: web.Application) -> None:
            if publisher is not None:   # before the engine runs: no block goes unannounced
                publisher.start()
                engine.add_kv_event_listener(publisher.on_event)
            await engine.start()
            if runtime is not None:
                await runtime.start(engine)
                state.pd = runtime

        async def stop(_: web.Application) -> None:
            if runtime is not None:
                await runtime.stop()
            await engine.shutdown()
            if publisher is not None:
                publisher.stop()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
    return app
