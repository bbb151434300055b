"""Turns an OpenAI request body into what scheduling needs, or a `Rejection`.

Only the fields routing depends on are checked (model, messages/prompt); the
worker validates the rest. The body is parsed by the same code as the
worker's (`kvyard.common.api`), so both refuse the same bodies. A rejection
carries the HTTP status and an OpenAI-style JSON body so that Envoy can return
it to the client unchanged; every answer the EPP gives itself is built here
(the admission ones below: shedding, the queue, the waiting room, shutdown).

A request without `model` is routed as the pool's (first) served model, as
vLLM serves it with its default model: gateway and worker agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from kvyard.common.api import CHAT_ROLES, BodyError, error_json, parse_json_object
from kvyard.common.wire import DROPPED_REASON_HEADER

OBJECTIVE_HEADER = "x-gateway-inference-objective"
# llm-d-router's name first; today's header stays as its alias.
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", OBJECTIVE_HEADER)


@dataclass(slots=True)
class Rejection(Exception):
    """A request the EPP answers itself (status, OpenAI error body, reason label).

    Raised where the problem is found (parsing, admission) and returned by
    `Director.handle` as the request's outcome.

    `reason` labels the error metric and is the body's `code` unless `code` is given.
    """

    status: int
    message: str
    reason: str  # short label for metrics, e.g. "invalid_json"
    err_type: str | None = None  # None: OpenAI's type for the status
    headers: tuple[tuple[str, str], ...] = ()
    code: str | None = None
    param: str | None = None

    def body(self) -> bytes:
        return error_json(self.status, self.message, self.code or self.reason, self.param,
                          self.err_type)


@dataclass(slots=True)
class ParsedRequest:
    model: str
    messages: list | None  # chat completions
    prompt: Any  # completions: str, list[str], list[int] or list[list[int]]
    priority: int
    max_tokens: int | None = None  # max_tokens / max_completion_tokens, when an int


def _bad(message: str, reason: str, param: str | None = None) -> Rejection:
    return Rejection(400, message, reason, param=param)


def priority_of(headers: dict[str, str], objectives: dict[str, int]) -> int:
    """The request's priority from `x-llm-d-inference-objective` (or its alias
    `x-gateway-inference-objective`).

    The value is either an InferenceObjective name (looked up in the EPP
    config) or a plain integer; unknown names mean priority 0 (not sheddable).
    """
    raw = next((v for h in OBJECTIVE_HEADERS if (v := headers.get(h, "").strip())), "")
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
    """Validates the body; raises Rejection (400/404)."""
    try:
        obj = parse_json_object(body)
    except BodyError as e:
        raise _bad(e.message, e.code) from None
    served = list(served_models or ())
    model = obj.get("model")
    if model is None:
        model = served[0] if served else ""
    elif not isinstance(model, str) or not model:
        raise Rejection(400, "'model' must be a non-empty string", "invalid_model",
                           param="model")
    elif served and model not in served:
        raise Rejection(404, f"The model '{model}' does not exist", "model_not_found",
                           param="model")
    route = path.split("?", 1)[0]
    messages = prompt = None
    if route.endswith("/chat/completions") or ("messages" in obj and "prompt" not in obj):
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "missing_messages", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise _bad("each message must be an object", "invalid_messages",
                           f"messages[{i}]")
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise _bad(f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                           f"got {str(role)[:40]!r}", "invalid_role", f"messages[{i}].role")
    elif route.endswith("/detokenize"):
        # vLLM's /detokenize takes token ids; they route like a completions prompt of ids
        prompt = obj.get("tokens")
        if not isinstance(prompt, list) or not prompt:
            raise _bad("'tokens' must be a non-empty list of token ids", "missing_tokens",
                       "tokens")
    else:
        prompt = obj.get("prompt", obj.get("input"))
        if prompt is None or prompt == "" or prompt == []:
            raise _bad("missing 'prompt'", "missing_prompt", "prompt")
        if not isinstance(prompt, (str, list)):
            raise _bad("'prompt' must be a string or a list", "invalid_prompt", "prompt")
    mt = obj.get("max_completion_tokens", obj.get("max_tokens"))
    return ParsedRequest(model, messages, prompt, priority_of(headers, objectives or {}),
                         mt if type(mt) is int and mt > 0 else None)


def _dropped(status: int, message: str, reason: str, code: str,
             retry_after: str | None) -> Rejection:
    """Admission's refusals: `x-gateway-request-dropped-reason` names them, as llm-d's do."""
    headers = ((DROPPED_REASON_HEADER, code),)
    if retry_after is not None:
        headers += (("retry-after", retry_after),)
    return Rejection(status, message, reason, code=code, headers=headers)


def shed() -> Rejection:
    return _dropped(429, "the pool is saturated; sheddable request dropped", "shed",
                    "rejected-saturated", None)


def queue_full() -> Rejection:
    return _dropped(429, "the EPP's request queue is full", "queue_full", "rejected-queue-full",
                    "1")


def ttl_expired() -> Rejection:
    return _dropped(429, "the pool stayed saturated past this request's queue TTL",
                    "ttl_expired", "rejected-ttl-expired", "1")


def no_endpoint() -> Rejection:
    return _dropped(503, "no ready endpoint for this request", "no_endpoint",
                    "rejected-no-endpoints", "1")


def no_endpoint_in_time() -> Rejection:
    """The waiting room's TTL ran out: a cold start takes a while, so retry later."""
    return _dropped(503, "no endpoint became ready in time for this request", "no_endpoint",
                    "rejected-no-endpoints", "5")


def shutting_down() -> Rejection:
    return _dropped(503, "the endpoint picker is shutting down; retry", "shutting_down",
                    "rejected-shutting-down", "1")


def body_too_large(limit: int) -> Rejection:
    return Rejection(413, f"request body exceeds {limit} bytes", "body_too_large",
                     code="request_too_large")


def internal() -> Rejection:
    return Rejection(500, "internal error in the endpoint picker", "internal")


def slo_unattainable() -> Rejection:
    """SLO admission: a sheddable request no endpoint is predicted to serve within its SLO."""
    return _dropped(429, "no endpoint is predicted to meet this request's latency objective; "
                         "sheddable request dropped", "slo_shed", "rejected-slo-unattainable", "1")
