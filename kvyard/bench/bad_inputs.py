"""A corpus of bad requests, each of which must get a 4xx in OpenAI's error shape.

Shared by the stack's contract test (through the gateway to real workers, and
at a worker directly) and `kvyard bench hardening`, which counts the 5xx
answers (target 0). Cases cover each layer that can refuse: Envoy (size),
the EPP (body, model, messages) and the worker (every sampling field).
"""
from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "SmolLM2-135M-Instruct"


@dataclass(slots=True)
class Case:
    name: str
    body: bytes
    path: str = CHAT
    content_type: str = "application/json"


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


def _comp(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


def cases(body_limit: int = 4 << 20) -> list[Case]:
    nested = b"[" * 1000 + b"]" * 1000
    return [
        Case("not json", b"this is { not json"),
        Case("empty body", b""),
        Case("json array", b"[1, 2]"),
        Case("invalid utf-8", b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}'),
        Case("lone surrogate in message",
             b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        Case("lone surrogate in prompt", b'{"prompt": "\\udfff"}', COMPLETIONS),
        Case("nested 1000 deep", b'{"messages": ' + nested + b"}"),
        Case("nested 1000 deep in a field", _chat()[:-1] + b', "stop": ' + nested + b"}"),
        Case("unknown role", json.dumps({"messages": [{"role": "wizard",
                                                       "content": "hi"}]}).encode()),
        Case("no role", json.dumps({"messages": [{"content": "hi"}]}).encode()),
        Case("no messages", json.dumps({"model": MODEL}).encode()),
        Case("messages not a list", _chat(messages="hi")),
        Case("content wrong type", _chat(messages=[{"role": "user", "content": 5}])),
        Case("model wrong type", _chat(model=5)),
        Case("unknown model", _chat(model="no-such-model")),
        Case("prompt wrong type", _comp(prompt={"a": 1}), COMPLETIONS),
        Case("token id out of range", _comp(prompt=[1, 10**12]), COMPLETIONS),
        Case("max_tokens negative", _chat(max_tokens=-1)),
        Case("max_tokens string", _chat(max_tokens="10")),
        Case("max_tokens huge", _chat(max_tokens=10**12)),
        Case("temperature negative", _chat(temperature=-1)),
        Case("top_p above 1", _chat(top_p=2)),
        Case("n too large", _chat(n=10_000)),
        Case("stream not bool", _chat(stream="yes")),
        Case("20,000 stop strings", _chat(stop=[f"stop string number {i:06d} " * 2
                                                for i in range(20_000)])),
        Case("stop wrong type", _chat(stop=5)),
        Case("logit_bias huge", _chat(logit_bias={str(i): 1 for i in range(50_000)})),
        Case("logit_bias bad key", _chat(logit_bias={"x": 1})),
        Case("top_logprobs too many", _chat(logprobs=True, top_logprobs=100)),
        Case("tools unsupported", _chat(tools=[{"type": "function",
                                                "function": {"name": "f"}}])),
        Case("response_format bogus", _chat(response_format={"type": "yaml"})),
        Case("guided_regex backreference", _chat(guided_regex=r"(a)\1")),
        Case("prompt past the context", _comp(prompt="hello " * 200_000), COMPLETIONS),
        Case("body over the limit",
             b'{"messages": [{"role": "user", "content": "' + b"a" * (body_limit + 1024)
             + b'"}]}'),
    ]


@dataclass(slots=True)
class Answer:
    case: str
    status: int
    error: dict[str, Any] | None  # the parsed `error` object, None when not OpenAI-shaped
    seconds: float


def send(url: str, case: Case, timeout: float = 30.0) -> Answer:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", case.path, body=case.body,
                     headers={"Content-Type": case.content_type})
        r = conn.getresponse()
        status, data = r.status, r.read()
    except OSError as e:  # timed out or reset: no answer at all (status 0)
        status, data = 0, str(e).encode()
    finally:
        conn.close()
    return Answer(case.name, status, openai_error(data), time.monotonic() - t0)


def openai_error(data: bytes) -> dict[str, Any] | None:
    """The `error` object if `data` is OpenAI's error shape with a string code, else None."""
    try:
        err = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return None
    if not (isinstance(err["message"], str) and isinstance(err["type"], str)
            and isinstance(err["code"], str)):
        return None
    return err


def run_corpus(url: str, body_limit: int = 4 << 20) -> list[Answer]:
    return [send(url, c) for c in cases(body_limit)]
