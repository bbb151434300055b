"""Turns an OpenAI request body into what scheduling needs, or a client error.

Only the fields routing depends on are checked (model, messages/prompt); the
worker validates the rest. Errors carry the HTTP status and an OpenAI-style
JSON body so that Envoy can return them to the client unchanged.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

OBJECTIVE_HEADER = "x-gateway-inference-objective"


@dataclass(slots=True)
class RequestError(Exception):
    """A request the EPP answers itself (status, OpenAI error body, reason label)."""

    status: int
    message: str
    reason: str  # short label for metrics, e.g. "bad_json"
    err_type: str = "invalid_request_error"
    headers: tuple[tuple[str, str], ...] = ()

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.err_type,
                                     "param": None, "code": self.status}}).encode()


@dataclass(slots=True)
class ParsedRequest:
    model: str
    messages: list | None  # chat completions
    prompt: Any  # completions: str, list[str], list[int] or list[list[int]]
    priority: int


def _bad(message: str, reason: str) -> RequestError:
    return RequestError(400, message, reason)


def priority_of(headers: dict[str, str], objectives: dict[str, int]) -> int:
    """The request's priority from `x-gateway-inference-objective`.

    The value is either an InferenceObjective name (looked up in the EPP
    config) or a plain integer; unknown names mean priority 0 (not sheddable).
    """
    raw = headers.get(OBJECTIVE_HEADER, "").strip()
    if not raw:
        return 0
    if raw in objectives:
        return objectives[raw]
    try:
        return int(raw)
    except ValueError:
        return 0


def parse_request(body: bytes, path: str, headers: dict[str, str],
                  served_models: Iterable[str] | None,
                  objectives: dict[str, int] | None = None) -> ParsedRequest:
    """Validates the body; raises RequestError (400/404)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("request body is not valid UTF-8", "bad_utf8") from None
    try:
        obj = json.loads(text)
    except ValueError:
        raise _bad("request body is not valid JSON", "bad_json") from None
    if not isinstance(obj, dict):
        raise _bad("request body must be a JSON object", "bad_json")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("missing 'model'", "missing_model")
    served = list(served_models or ())
    if served and model not in served:
        raise RequestError(404, f"The model '{model}' does not exist", "unknown_model",
                           err_type="NotFoundError")
    route = path.split("?", 1)[0]
    messages = prompt = None
    if route.endswith("/chat/completions") or ("messages" in obj and "prompt" not in obj):
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "missing_messages")
        if not all(isinstance(m, dict) for m in messages):
            raise _bad("each message must be an object", "bad_messages")
    else:
        prompt = obj.get("prompt", obj.get("input"))
        if prompt is None or prompt == "" or prompt == []:
            raise _bad("missing 'prompt'", "missing_prompt")
        if not isinstance(prompt, (str, list)):
            raise _bad("'prompt' must be a string or a list", "bad_prompt")
    return ParsedRequest(model, messages, prompt, priority_of(headers, objectives or {}))
