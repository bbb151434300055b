"""What every handler of one server shares, kept on the aiohttp app under a typed key."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    engine: Any                 # kvyard.workers.engine.async_engine.AsyncLLMEngine (duck-typed)
    served_names: list[str]     # the first is reported in responses that do not echo `model`
    advertise: str              # host:port that the x-kvyard-endpoint header carries
    role: str
    metrics: ServerMetrics
    vocab_size: int | None = None  # bounds token-id prompts when the tokenizer tells us
    max_token_chars: int | None = None  # most characters one token covers: a cheap length bound
    started_at: float = field(default_factory=time.time)
    pd: Any = None              # kvyard.workers.pd.runtime.PDRuntime once started, or None


STATE: web.AppKey[ServerState] = web.AppKey("kvyard_state", ServerState)


def get_state(app: web.Application) -> ServerState:
    return app[STATE]
