"""LoRA on the HTTP surface, as vLLM: adapters are models a request names in `model`,
listed in `/v1/models` with their `parent`; `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` exist only when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is
true (vLLM's switch), answer vLLM's plain-text successes and its messages and error
types on failure. The gateway never routes these paths (gateway/config.py serves the
API paths only)."""
from __future__ import annotations

import asyncio
import os
from typing import Any

from aiohttp import web

from .body import read_json
from .errors import ApiError
from .state import get_state

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def manager_of(engine: Any):
    """The engine's workers.lora.manager.LoRAManager, or None (LoRA off)."""
    inner = getattr(engine, "engine", engine)
    return getattr(inner, "lora", None)


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


def model_names(state) -> list[str]:
    """Every name a request may put in `model`: the served names, then the adapters."""
    mgr = manager_of(state.engine)
    return state.served_names + ([m.name for m in mgr.modules()] if mgr is not None else [])


def adapter_for(state, model: str) -> str | None:
    """The LoRA adapter a request's `model` names, None for the base model."""
    if model in state.served_names:
        return None
    mgr = manager_of(state.engine)
    return model if mgr is not None and mgr.serves(model) else None


async def models(request: web.Request) -> web.Response:
    state = get_state(request.app)
    created = int(state.started_at)
    base = state.served_names[0]
    data = [{"id": name, "object": "model", "created": created, "owned_by": "kvyard",
             "root": base, "parent": None, "max_model_len": state.engine.max_model_len}
            for name in state.served_names]
    mgr = manager_of(state.engine)
    for m in mgr.modules() if mgr is not None else ():
        data.append({"id": m.name, "object": "model", "created": created, "owned_by": "kvyard",
                     "root": m.path, "parent": m.base_model_name or base,
                     "max_model_len": state.engine.max_model_len})
    return web.json_response({"object": "list", "data": data})


def _user_error(message: str, status: int = 400, type_: str = "InvalidUserInput") -> ApiError:
    return ApiError(status, message, code=str(status), type_=type_)


async def load_lora_adapter(request: web.Request) -> web.Response:
    from kvyard.workers.lora.adapter import LoRAError
    from kvyard.workers.lora.config import LoRAModule

    state = get_state(request.app)
    mgr = manager_of(state.engine)
    body = await read_json(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path or not isinstance(name, str) or not isinstance(path, str):
        raise _user_error("Both 'lora_name' and 'lora_path' must be provided.")
    if name in state.served_names:
        raise _user_error(f"The lora adapter '{name}' has the name of the base model.")
    base = body.get("base_model_name")
    module = LoRAModule(name, path, base if isinstance(base, str) and base in state.served_names else None)
    try:
        await asyncio.to_thread(mgr.add, module)  # reads the weights: off the event loop
    except LoRAError as e:
        msg = str(e)
        if "already been loaded" in msg:
            raise _user_error(msg) from None
        if "No adapter found" in msg:
            raise _user_error(msg, 404, "NotFoundError") from None
        raise _user_error(msg, 400, "BadRequestError") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = get_state(request.app)
    mgr = manager_of(state.engine)
    body = await read_json(request)
    name = body.get("lora_name")
    if not name or not isinstance(name, str):
        raise _user_error("either 'lora_name' and 'lora_int_id' needs to be provided.")
    try:
        mgr.remove(name)
    except KeyError:
        raise _user_error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def install(app: web.Application, engine: Any) -> None:
    """The runtime routes, when LoRA is on and the environment allows them."""
    if manager_of(engine) is not None and runtime_updates_allowed():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
