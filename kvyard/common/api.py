"""What every client-facing component agrees on: the OpenAI error shape, the
chat roles, and how a request body becomes a JSON object (or a 400).

The worker, the EPP and the gateway's own replies all answer errors as
`{"error": {"message", "type", "param", "code"}}`, with OpenAI's `type`
values and a string `code`, so an SDK reports the same thing whichever hop
refused the request. Bad input is always a 4xx: OpenAI's SDKs retry 5xx, so a
500 for a bad body would be repeated work.

Body parsing is shared because both the EPP and the worker must refuse the
same bodies the same way: invalid UTF-8, invalid JSON, a non-object, JSON
nested deeper than `MAX_JSON_DEPTH` (Python's parser raises RecursionError
near 1,000 levels, and deep structures recurse again later, e.g. in schema
compilation), and lone UTF-16 surrogates (`"\\ud800"` is valid JSON but no
valid text: encoding it later would fail).
"""
from __future__ import annotations

import json
import re
from typing import Any

# OpenAI's `type` per status; anything else 4xx is invalid_request_error, 5xx server_error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}

# The roles OpenAI's chat API accepts.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# Nesting deeper than this in a request body is refused (objects and arrays both count).
MAX_JSON_DEPTH = 64

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str, param: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or error_type(status),
                      "param": param, "code": code}}


def error_json(status: int, message: str, code: str, param: str | None = None,
               type_: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, code, param, type_)).encode()


class BodyError(ValueError):
    """A body that is not a JSON object we accept; always a 400."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _check(obj: Any, check_strings: bool) -> None:
    """Depth bound, and (when the text had surrogate escapes) valid text, without
    recursion; scalars are skipped in comprehensions (a list of 20,000 strings is
    common enough: stop lists, batches)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    containers = (dict, list)
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BodyError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                            "too_deep")
        values = node.values() if isinstance(node, dict) else node
        if check_strings:
            for s in (*node, *values) if isinstance(node, dict) else node:
                if isinstance(s, str):
                    _valid_text(s)
        stack.extend([(v, depth + 1) for v in values if isinstance(v, containers)])


def _valid_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(f"request body has a lone UTF-16 surrogate ({s[e.start]!a}); "
                        "strings must be valid Unicode text", "invalid_encoding") from None


def parse_json_object(data: bytes) -> dict[str, Any]:
    """The body as a dict, or BodyError. Linear in the body's size."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid UTF-8: {e.reason} at byte {e.start}",
                        "invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise BodyError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                        "too_deep") from None
    except ValueError as e:
        raise BodyError(f"request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise BodyError("request body must be a JSON object", "invalid_json")
    surrogates = _SURROGATE_ESCAPE.search(data) is not None
    if surrogates or data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH:
        _check(obj, surrogates)  # fewer brackets than that can't nest deeper: no walk
    return obj
