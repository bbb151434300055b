"""A corpus of bad requests against a real worker: every answer is a 4xx in OpenAI's
shape with a string code (never a 5xx, which OpenAI's SDKs would retry), nothing
reaches the unhandled-error path, and a normal request is served afterwards."""
from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any, Iterator

from kvyard.workers.server.testing import WorkerProcess

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
NESTED = "[" * 1000 + "]" * 1000
# wrong values for each field; each must be refused in either endpoint where it applies
BAD: dict[str, list[Any]] = {
    "model": [5, [], {}, True, "no-such-model"],
    "max_tokens": ["5", 1.5, -1, 0, True, [], 10**12, 10**100],
    "max_completion_tokens": ["5", -3, 1.5],
    "temperature": ["hot", -1, 3, [], True, {}],
    "top_p": [0, 2, "x", -0.5],
    "top_k": ["x", -2, 1.5, 0.5],
    "n": ["2", 0, 17, 1.5, True, 10**9],
    "stream": ["yes", 1, [], {}],
    "stream_options": [[], "x", {"include_usage": "yes"}],
    "stop": [5, [5], [""], {}, [[]], [None], ["x" * 513], ["s"] * 129],
    "stop_token_ids": ["x", [-1], [1.5], ["a"], 5, [True], list(range(300))],
    "seed": ["x", 1.5, 2**64, -(2**63) - 1, []],
    "ignore_eos": ["x", 1],
    "presence_penalty": [3, "x", -3],
    "frequency_penalty": [3, [], -2.5],
    "repetition_penalty": [0, -1, "x", 11],
    "min_tokens": [-1, "x", 1.5, 10**6],
    "logit_bias": [[], "x", {"a": 1}, {"1": "x"}, {"1": 1000}, {"-1": 1}, {"1": None},
                   {"99999999999": 1}, {str(i): 1 for i in range(2000)}],
    "response_format": ["x", 5, {"type": 5}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"schema": "x"}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}},
                        {"type": "json_schema", "json_schema": {"schema": {"$defs": [1]}}}],
    "guided_json": [5, "not json", "[1]", {"type": "string"}, {"$defs": []},
                    '{"a": "\\ud800"}', {"type": "object", "properties": []},
                    {"type": "object", "properties": {"a": {"type": "strange"}}},
                    {"type": "object", "properties": {"a": {"enum": []}}},
                    {"type": "object", "properties": {"a": {"$ref": "http://x"}}}],
    "guided_choice": ["x", [], [5], [""], [["a"]], ["c"] * 2000],
    "guided_regex": [5, "", "(a", "(a)\\1", "a{3,1}", "(?=x)", "a" * 5000, "[z-a]"],
    "prompt_logprobs": ["x", -1, 21, 1.5],
    "suffix": ["x"],
    "best_of": [2, "x"],
    "tools": [[{"type": "function", "function": {"name": "f"}}]],
}
COMPLETION_ONLY = {"logprobs": ["x", -1, 21, 1.5, True], "echo": ["x", 1],
                   "prompt": [5, {}, True, [[]], [1.5], [-1], [True], [], "", [10**12], ["a", 5],
                              [[1], "a", {}], ["a"] * 65, "\ud800x"]}
CHAT_ONLY = {"logprobs": [3, "x"], "top_logprobs": [21, "x", -1], "echo": [True],
             "messages": [5, "x", {}, [], [5], [{"role": 5, "content": "hi"}],
                          [{"role": "wizard", "content": "hi"}], [{"role": "", "content": "x"}],
                          [{"role": "user"}], [{"role": "user", "content": 5}],
                          [{"role": "user", "content": [{"type": "image_url"}]}],
                          [{"role": "user", "content": [5]}],
                          [{"role": "user", "content": "a\ud800"}],
                          [{"role": "user", "content": "hi"}] * 3000]}


@dataclass(slots=True)
class Bad:
    name: str
    path: str
    body: bytes
    content_type: str | None = "application/json"


def corpus() -> Iterator[Bad]:
    for path, base, only in ((COMP, {"prompt": "hi"}, COMPLETION_ONLY),
                             (CHAT, {"messages": USER}, CHAT_ONLY)):
        for field, values in {**BAD, **only}.items():
            for i, v in enumerate(values):
                body = json.dumps({**base, "max_tokens": 2, field: v})
                yield Bad(f"{path} {field}[{i}]", path, body.encode("utf-8", "surrogatepass"))
        yield Bad(f"{path} empty body", path, b"")
        yield Bad(f"{path} not json", path, b"{not json")
        yield Bad(f"{path} truncated", path, b'{"prompt": "hi"')
        yield Bad(f"{path} a list", path, b"[1, 2]")
        yield Bad(f"{path} a string", path, b'"hi"')
        yield Bad(f"{path} null", path, b"null")
        yield Bad(f"{path} NaN", path, b'{"prompt": "hi", "messages": [], "temperature": NaN}')
        yield Bad(f"{path} invalid utf-8", path, b'{"prompt": "\xff\xfe"}')
        yield Bad(f"{path} nested 1000 deep", path, b'{"prompt": ' + NESTED.encode() + b"}")
        yield Bad(f"{path} nested in a field", path,
                  b'{"prompt": "hi", "messages": [], "stop": ' + NESTED.encode() + b"}")
        yield Bad(f"{path} lone surrogate", path,
                  b'{"prompt": "a\\ud800", "messages": [{"role": "user", "content": "\\udfff"}]}')
        yield Bad(f"{path} huge int", path,
                  b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}")
        huge = "a " * 1_000_000
        yield Bad(f"{path} huge prompt", path, json.dumps(
            {"prompt": huge, "messages": [{"role": "user", "content": huge}]}).encode())
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                      "application/xml"):
            yield Bad(f"{path} content type {ctype}", path, b'{"prompt": "hi"}', ctype)
    yield Bad("detokenize wrong type", "/detokenize", b'{"tokens": "abc"}')
    yield Bad("detokenize out of vocab", "/detokenize", b'{"tokens": [1000000000]}')
    yield Bad("tokenize bad role", "/tokenize", b'{"messages": [{"role": "x", "content": "a"}]}')
    yield Bad("tokenize surrogate", "/tokenize", b'{"prompt": "\\ud800"}')


def send(worker: WorkerProcess, bad: Bad) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=120)
    try:
        headers = {} if bad.content_type is None else {"Content-Type": bad.content_type}
        conn.request("POST", bad.path, body=bad.body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def openai_error(raw: bytes) -> dict | None:
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    ok = isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} \
        and all(isinstance(err[k], str) for k in ("message", "type", "code")) \
        and err["type"] == "invalid_request_error"
    return err if ok else None


def test_every_bad_request_is_a_4xx_in_openai_shape_and_the_worker_keeps_serving(worker) -> None:
    cases = list(corpus())
    assert len(cases) > 250
    wrong = []
    for bad in cases:
        status, raw = send(worker, bad)
        if not (400 <= status < 500 and openai_error(raw) is not None):
            wrong.append(f"{bad.name}: {status} {raw[:200]!r}")
    assert wrong == []
    status, raw = send(worker, Bad("good", COMP, json.dumps(
        {"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1
    assert "unhandled error" not in worker.log_tail(1 << 20)


def test_a_body_without_a_content_type_is_read_as_json(worker) -> None:
    """As vLLM does; only a type that says something else is refused (415)."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    assert send(worker, Bad("no type", COMP, body, None))[0] == 200
    status, raw = send(worker, Bad("form", COMP, body, "application/x-www-form-urlencoded"))
    assert status == 415 and openai_error(raw)["code"] == "unsupported_media_type"
