"""OpenAI-shaped errors, so every client library can report what went wrong.

Handlers raise `ApiError`; the middleware turns it (and aiohttp's own HTTP
exceptions: unknown route, wrong method, body too large) into the JSON body
OpenAI's SDKs parse: `{"error": {"message", "type", "param", "code"}}`, with
OpenAI's `type` for the status and always a string `code`
(kvyard.common.api, shared with the EPP). Anything unexpected becomes a 500
of the same shape and is logged, so one bad request never takes the server
down; bad input never gets there (OpenAI's SDKs retry 5xx).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from kvyard.common.api import error_body, error_type

log = logging.getLogger("kvyard.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """A client-visible failure with the HTTP status it maps to and a string code."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param, self.type)

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def _from_http(exc: web.HTTPException) -> ApiError:
    """Rephrases aiohttp's plain-text errors; the codes mirror OpenAI's where it has one."""
    if exc.status == 404:
        return ApiError(404, "not found", code="not_found")
    if exc.status == 405:
        return ApiError(405, f"method not allowed: {exc.reason}", code="method_not_allowed")
    if exc.status == 413:
        return ApiError(413, f"request body too large: {exc.text}", code="request_too_large")
    # any other status: its reason phrase as the code ("Bad Request" -> "bad_request")
    return ApiError(exc.status, exc.text or exc.reason,
                    code=exc.reason.lower().replace(" ", "_").replace("-", "_"))


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _from_http(e).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: nobody to answer
    except Exception:  # noqa: BLE001 - keep serving; the log has the traceback
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(500, "internal server error", code="internal_error").response()


def sse_error(err: ApiError) -> bytes:
    """An error after a stream has started: the status line is gone, so it rides as an
    event, in the same shape (the status is in the message's type, the code a string)."""
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
