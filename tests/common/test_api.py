"""The shared body parser and error shape (what the EPP and the worker both refuse)."""
from __future__ import annotations

import json

import pytest

from kvyard.common.api import (
    MAX_JSON_DEPTH, BodyError, error_body, error_type, parse_json_object,
)


@pytest.mark.parametrize("raw,code", [
    (b"\xff{}", "invalid_encoding"),
    (b"{nope", "invalid_json"),
    (b'{"a": NaN}', "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (b'{"a": "\\ud800"}', "invalid_encoding"),
    (b'{"a": ["ok", {"b": "x\\uDC00y"}]}', "invalid_encoding"),
    (b'{"\\ud800": 1}', "invalid_encoding"),
    (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "too_deep"),
    (b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "too_deep"),
    (b'{"a": ' + b'{"b": ' * MAX_JSON_DEPTH + b"1" + b"}" * MAX_JSON_DEPTH + b"}", "too_deep"),
])
def test_refused_bodies(raw, code):
    with pytest.raises(BodyError) as e:
        parse_json_object(raw)
    assert e.value.code == code and e.value.message


def test_accepted_bodies():
    deep = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert parse_json_object(deep)["a"]
    # a surrogate pair is one valid character
    assert parse_json_object(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}
    assert parse_json_object(json.dumps({"p": list(range(1000))}).encode())["p"][-1] == 999


def test_error_shape_and_types():
    assert error_body(400, "m", "c") == {"error": {"message": "m", "type": "invalid_request_error",
                                                   "param": None, "code": "c"}}
    assert [error_type(s) for s in (400, 401, 403, 404, 413, 429, 500, 503)] == [
        "invalid_request_error", "authentication_error", "permission_error",
        "invalid_request_error", "invalid_request_error", "rate_limit_error", "server_error",
        "server_error"]
