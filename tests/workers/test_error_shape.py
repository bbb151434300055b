"""The worker's error contract in its parts: OpenAI's `type` per status, a string
`code` on every error the server can raise, the same shape inside a stream."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from aiohttp import web

import kvyard.workers.server as server
from kvyard.workers.server.errors import ApiError, _from_http, sse_error

SERVER_DIR = Path(server.__file__).parent


def test_every_api_error_the_server_raises_names_a_code() -> None:
    missing = []
    for path in sorted(SERVER_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ApiError":
                if not any(k.arg == "code" for k in node.keywords):
                    missing.append(f"{path.name}:{node.lineno}")
    assert missing == []


@pytest.mark.parametrize("status, type_", [
    (400, "invalid_request_error"), (404, "invalid_request_error"),
    (413, "invalid_request_error"), (415, "invalid_request_error"),
    (401, "authentication_error"), (403, "permission_error"), (429, "rate_limit_error"),
    (500, "server_error"), (503, "server_error"),
])
def test_openai_types_per_status(status: int, type_: str) -> None:
    err = ApiError(status, "m", code="c").body()["error"]
    assert err == {"message": "m", "type": type_, "param": None, "code": "c"}


def test_an_error_inside_a_stream_has_the_same_shape() -> None:
    raw = sse_error(ApiError(503, "engine failed", code="engine_error"))
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    err = json.loads(raw[6:])["error"]
    assert err == {"message": "engine failed", "type": "server_error", "param": None,
                   "code": "engine_error"}


@pytest.mark.parametrize("exc", [web.HTTPNotFound(), web.HTTPMethodNotAllowed("GET", ["POST"]),
                                 web.HTTPRequestEntityTooLarge(10, 20), web.HTTPBadRequest(),
                                 web.HTTPUnsupportedMediaType(), web.HTTPRequestTimeout()])
def test_aiohttps_own_errors_get_string_codes(exc: web.HTTPException) -> None:
    err = _from_http(exc).body()["error"]
    assert isinstance(err["code"], str) and err["code"] and err["type"] == "invalid_request_error"
