"""A request body as a JSON object, refused as early and as cheaply as possible.

The order is the point: the declared size is checked before a byte is read
(a 10 MB body costs a header's parse, not a read, a JSON parse and a
tokenization), the size again while reading (chunked bodies declare none),
then the content type, then `kvyard.common.api.parse_json_object`, the parser
the EPP uses too, so both refuse the same bodies the same way.

The default limit sits a little above the gateway's (kvyard/gateway/config.py,
4 MiB): behind the gateway its 413 is the one clients see, and a body it let
through is never refused here; a worker reached directly refuses the same
sizes.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from kvyard.common.api import BodyError, parse_json_object

from .errors import ApiError

GATEWAY_BODY_LIMIT = 4 << 20
DEFAULT_MAX_BODY_BYTES = GATEWAY_BODY_LIMIT + (64 << 10)

_JSON_TYPES = ("application/json",)


def too_large(limit: int, size: int | None = None) -> ApiError:
    got = f" (this one has {size} bytes)" if size is not None else ""
    return ApiError(413, f"request body too large: the limit is {limit} bytes{got}",
                    code="request_too_large")


def check_declared_size(request: web.Request) -> None:
    """A 413 from Content-Length alone, before anything is read."""
    limit = request.client_max_size  # the app's limit, which aiohttp enforces while reading
    size = request.content_length
    if limit and size is not None and size > limit:
        raise too_large(limit, size)


def _check_content_type(request: web.Request) -> None:
    """JSON, or no type at all (vLLM parses those as JSON too); anything else is a 415,
    so a form post (curl -d without a header) is told why instead of half-parsed."""
    if "Content-Type" not in request.headers:
        return
    ctype = request.content_type.lower()
    if ctype in _JSON_TYPES or ctype.endswith("+json"):
        return
    raise ApiError(415, f"request body must be JSON (Content-Type: application/json), got "
                   f"{request.headers['Content-Type'][:80]!r}", code="unsupported_media_type")


async def read_body(request: web.Request) -> bytes:
    """The raw body within the limit (413 beyond it, declared or not)."""
    check_declared_size(request)
    _check_content_type(request)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(request.client_max_size) from None


def parse_object(data: bytes) -> dict[str, Any]:
    """`data` as a JSON object, or a 400 with the shared parser's code."""
    try:
        return parse_json_object(data)
    except BodyError as e:
        raise ApiError(400, e.message, code=e.code) from None


async def read_json(request: web.Request) -> dict[str, Any]:
    return parse_object(await read_body(request))
