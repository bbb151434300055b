"""A worker's bounds on one request's work (README "Request limits"), on a real worker
with the default flags: bodies refused from their declared size before a byte is
read, prompts certainly too long refused before tokenizing, every growing structure
capped with a 400 naming its cap, and requests without `model` served (vLLM's way)."""
from __future__ import annotations

import http.client
import json
import socket
from typing import Any

import pytest

from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.workers.server import limits
from kvyard.workers.server.body import DEFAULT_MAX_BODY_BYTES, GATEWAY_BODY_LIMIT
from kvyard.workers.server.testing import WorkerProcess

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def post(worker: WorkerProcess, path: str, body: Any, headers: dict | None = None,
         chunked: bool = False) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=120)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if chunked:
            pieces = (raw[i:i + (1 << 16)] for i in range(0, len(raw), 1 << 16))
            conn.request("POST", path, body=pieces, headers=hdrs, encode_chunked=True)
        else:
            conn.request("POST", path, body=raw, headers=hdrs)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def error(worker: WorkerProcess, path: str, body: Any, status: int = 400, **kw: Any) -> dict:
    got, out = post(worker, path, body, **kw)
    assert got == status, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str)
    assert err["type"] == "invalid_request_error"
    return err


def test_the_default_body_limit_is_the_gateways_plus_a_little() -> None:
    assert GATEWAY_BODY_LIMIT < DEFAULT_MAX_BODY_BYTES <= GATEWAY_BODY_LIMIT + (1 << 20)


def test_a_declared_size_over_the_limit_is_413_before_the_body_is_sent(worker) -> None:
    """Headers only: the answer must come without the worker waiting for 10 MB."""
    with socket.create_connection(("127.0.0.1", worker.port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n{")
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 20:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b'"request_too_large"' in body and str(DEFAULT_MAX_BODY_BYTES).encode() in body


def test_a_chunked_body_over_the_limit_is_413(worker) -> None:
    big = b'{"prompt": "' + b"a" * DEFAULT_MAX_BODY_BYTES + b'"}'
    assert error(worker, COMP, big, 413, chunked=True)["code"] == "request_too_large"


def test_a_body_the_gateway_lets_through_is_not_refused_for_its_size(worker) -> None:
    """At the gateway's 4 MiB: a 400 for the prompt's length, not a 413."""
    body = b'{"prompt": "' + b"a " * ((GATEWAY_BODY_LIMIT - 20) // 2) + b'"}'
    assert len(body) <= GATEWAY_BODY_LIMIT
    assert error(worker, COMP, body)["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, field, make", [
    (COMP, "prompt", lambda n: {"prompt": "word " * n}),
    (CHAT, "messages", lambda n: {"messages": [{"role": "user", "content": "word " * n}]}),
])
def test_a_prompt_certainly_past_the_context_is_refused_before_tokenizing(worker, path, field,
                                                                         make) -> None:
    """The message counts characters, not tokens: the prompt was never tokenized."""
    err = error(worker, path, make(400_000))
    assert err["code"] == "context_length_exceeded" and err["param"] == field
    assert "2000000 characters" in err["message"], err["message"]


def test_a_token_id_prompt_past_the_context_is_refused_by_its_length(worker) -> None:
    err = error(worker, COMP, {"prompt": [5] * 300_000})
    assert err["code"] == "context_length_exceeded" and "300000 tokens" in err["message"]


@pytest.mark.parametrize("body, param, cap", [
    ({"stop": [f"s{i}" for i in range(limits.MAX_STOP_STRINGS + 1)]}, "stop",
     f"at most {limits.MAX_STOP_STRINGS} stop strings"),
    ({"stop": [f"stop string number {i:06d} " * 2 for i in range(20_000)]}, "stop",
     f"at most {limits.MAX_STOP_STRINGS} stop strings"),
    ({"stop": ["x" * (limits.MAX_STOP_CHARS + 1)]}, "stop",
     f"at most {limits.MAX_STOP_CHARS} characters"),
    ({"stop_token_ids": list(range(limits.MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids",
     f"at most {limits.MAX_STOP_TOKEN_IDS}"),
    ({"logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS + 1)}}, "logit_bias",
     f"at most {limits.MAX_LOGIT_BIAS}"),
    ({"messages": USER * (limits.MAX_MESSAGES + 1)}, "messages", f"at most {limits.MAX_MESSAGES}"),
    ({"guided_choice": ["y" * (limits.MAX_GUIDED_CHOICE_CHARS + 1)]}, "guided_choice",
     f"1 to {limits.MAX_GUIDED_CHOICE_CHARS} characters"),
    ({"guided_regex": "a" * (limits.MAX_REGEX_CHARS + 1)}, "guided_regex",
     f"1 to {limits.MAX_REGEX_CHARS} characters"),
    ({"guided_regex": "((a?){100}){49}"}, "guided_regex", "states"),
    ({"guided_json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                      "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}}},
     "guided_json", "refers back to itself"),
    ({"guided_json": '{"type": "object", "properties": ' + "[" * 100 + "]" * 100 + "}"},
     "guided_json", "nested deeper"),
])
def test_each_growing_structure_has_a_cap_named_in_its_400(worker, body, param, cap) -> None:
    full = {"messages": USER, "max_tokens": 2, **body}
    err = error(worker, CHAT, full)
    assert err["param"] == param and cap in err["message"], err


def test_stop_strings_at_the_cap_are_accepted_and_cut_the_output(worker) -> None:
    _, plain = post(worker, COMP, {"prompt": "The capital of France is", "max_tokens": 12,
                                   "temperature": 0, "ignore_eos": True})
    text = plain["choices"][0]["text"]
    word = text[3:7]
    stops = ["x" * (limits.MAX_STOP_CHARS - 3) + f"{i:03d}"
             for i in range(limits.MAX_STOP_STRINGS - 1)] + [word]
    status, cut = post(worker, COMP, {"prompt": "The capital of France is", "max_tokens": 12,
                                      "temperature": 0, "ignore_eos": True, "stop": stops})
    assert status == 200, cut
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[:text.index(word)]


def test_an_unknown_chat_role_is_refused(worker) -> None:
    err = error(worker, CHAT, {"messages": [USER[0], {"role": "wizard", "content": "hi"}]})
    assert err["param"] == "messages[1].role" and "wizard" in err["message"]


def test_a_request_without_model_is_served_by_the_default_model(worker) -> None:
    """vLLM's behaviour: no `model` means the first served name."""
    for path, body in ((CHAT, {"messages": USER}), (COMP, {"prompt": "hi"})):
        status, out = post(worker, path, {**body, "max_tokens": 2})
        assert status == 200 and out["model"] == DEMO_SERVED_NAME, out
