"""Bad input gets the right status and OpenAI's error shape, and the server keeps serving.

A real worker (demo model) with a small body limit, so the 413 path is cheap
to reach. After every bad request a valid one must still succeed.
"""
from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Iterator

import pytest

from kvyard.common.wire import ENDPOINT_HEADER
from kvyard.workers.server.testing import WorkerProcess, start_worker

MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, demo_gguf: Path) -> Iterator[WorkerProcess]:
    assert demo_gguf.is_file()
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len",
                      str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "32MiB", "--num-threads",
                      "1", "--max-body-bytes", "64KiB", "--advertise-address", "10.1.2.3:8000"],
                     log)
    yield w
    assert w.stop() == 0, w.log_tail()


def request(worker: WorkerProcess, method: str, path: str,
            body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=120)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _j(obj: object) -> bytes:
    return json.dumps(obj).encode()


CHAT, COMP = "/v1/chat/completions", "/v1/completions"
# id -> (path, raw body, status, error code, substring the message must contain)
CASES: dict[str, tuple[str, bytes, int, str, str]] = {
    "invalid-json": (COMP, b'{"prompt": "hi",', 400, "invalid_json", "not valid JSON"),
    "not-an-object": (COMP, b"[1, 2]", 400, "invalid_json", "JSON object"),
    "invalid-utf8": (COMP, b'{"prompt": "\xff\xfe"}', 400, "invalid_encoding", "UTF-8"),
    "nan": (COMP, b'{"prompt": "hi", "temperature": NaN}', 400, "invalid_json", "NaN"),
    "temperature-type": (COMP, _j({"prompt": "hi", "temperature": "hot"}), 400,
                         "invalid_type", "temperature"),
    "max-tokens-type": (COMP, _j({"prompt": "hi", "max_tokens": "5"}), 400, "invalid_type",
                        "max_tokens"),
    "seed-too-big": (COMP, _j({"prompt": "hi", "seed": 1 << 70}), 400, "invalid_value",
                     "64 bits"),
    "stop-type": (COMP, _j({"prompt": "hi", "stop": [1, 2]}), 400, "invalid_type", "stop"),
    "top-p-zero": (COMP, _j({"prompt": "hi", "top_p": 0}), 400, "invalid_value", "top_p"),
    "stream-type": (COMP, _j({"prompt": "hi", "stream": "yes"}), 400, "invalid_type", "stream"),
    "prompt-type": (COMP, _j({"prompt": 42}), 400, "invalid_type", "prompt"),
    "prompt-missing": (COMP, _j({"max_tokens": 3}), 400, "missing_required", "prompt"),
    "messages-missing": (CHAT, _j({"max_tokens": 3}), 400, "missing_required", "messages"),
    "messages-empty": (CHAT, _j({"messages": []}), 400, "invalid_value", "non-empty"),
    "messages-type": (CHAT, _j({"messages": "hi"}), 400, "invalid_value", "non-empty"),
    "message-no-role": (CHAT, _j({"messages": [{"content": "hi"}]}), 400, "invalid_type",
                        "role"),
    "unknown-model": (CHAT, _j({"model": "gpt-9", "messages": USER}), 404, "model_not_found",
                      "gpt-9"),
    "max-tokens-zero": (COMP, _j({"prompt": "hi", "max_tokens": 0}), 400, "invalid_value",
                        "at least 1"),
    "max-tokens-negative": (CHAT, _j({"messages": USER, "max_completion_tokens": -4}), 400,
                            "invalid_value", "at least 1"),
    "too-long": (COMP, _j({"prompt": [1] * 200, "max_tokens": 100}), 400,
                 "context_length_exceeded", f"{MAX_MODEL_LEN} tokens"),
    "prompt-fills-context": (COMP, _j({"prompt": [1] * MAX_MODEL_LEN}), 400,
                             "context_length_exceeded", f"{MAX_MODEL_LEN} tokens"),
    "n-zero": (CHAT, _j({"messages": USER, "n": 0}), 400, "invalid_value", "'n'"),
    "n-too-many": (COMP, _j({"prompt": "hi", "n": 17}), 400, "invalid_value", "'n'"),
    "too-many-choices": (COMP, _j({"prompt": ["a"] * 9, "n": 8}), 400, "invalid_value",
                         "at most 64 choices"),
    "batch-item-type": (COMP, _j({"prompt": ["a", 3]}), 400, "invalid_type", "prompt[1]"),
    "batch-item-empty": (COMP, _j({"prompt": ["a", []]}), 400, "invalid_type", "prompt[1]"),
    "detokenize-type": ("/detokenize", _j({"tokens": "abc"}), 400, "invalid_type", "tokens"),
    "detokenize-range": ("/detokenize", _j({"tokens": [10**9]}), 400, "invalid_value",
                         "vocabulary"),
    "response-format-type": (CHAT, _j({"messages": USER, "response_format": {"type": "xml"}}),
                             400, "invalid_value", "response_format"),
    "best-of": (COMP, _j({"prompt": "hi", "best_of": 2}), 400, "unsupported_parameter",
                "best_of"),
    "chat-echo": (CHAT, _j({"messages": USER, "echo": True}), 400, "unsupported_parameter",
                  "echo"),
    "echo-type": (COMP, _j({"prompt": "hi", "echo": "yes"}), 400, "invalid_type", "echo"),
    "top-logprobs-too-many": (CHAT, _j({"messages": USER, "logprobs": True, "top_logprobs": 21}),
                              400, "invalid_value", "top_logprobs"),
    "top-logprobs-without-logprobs": (CHAT, _j({"messages": USER, "top_logprobs": 2}), 400,
                                      "invalid_value", "needs 'logprobs'"),
    "logprobs-too-many": (COMP, _j({"prompt": "hi", "logprobs": 21}), 400, "invalid_value",
                          "logprobs"),
    "chat-logprobs-type": (CHAT, _j({"messages": USER, "logprobs": 3}), 400, "invalid_type",
                           "logprobs"),
    "presence-penalty-range": (COMP, _j({"prompt": "hi", "presence_penalty": 2.5}), 400,
                               "invalid_value", "presence_penalty"),
    "repetition-penalty-zero": (COMP, _j({"prompt": "hi", "repetition_penalty": 0}), 400,
                                "invalid_value", "repetition_penalty"),
    "min-tokens-negative": (COMP, _j({"prompt": "hi", "min_tokens": -1}), 400, "invalid_value",
                            "min_tokens"),
    "min-tokens-over-max": (COMP, _j({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}), 400,
                            "invalid_request", "min_tokens"),
    "logit-bias-key": (COMP, _j({"prompt": "hi", "logit_bias": {"abc": 1}}), 400,
                       "invalid_value", "logit_bias"),
    "logit-bias-value": (COMP, _j({"prompt": "hi", "logit_bias": {"5": 101}}), 400,
                         "invalid_value", "logit_bias"),
    "logit-bias-out-of-vocab": (COMP, _j({"prompt": "hi", "logit_bias": {"999999999": 5}}), 400,
                                "invalid_value", "vocabulary"),
    "token-out-of-vocab": (COMP, _j({"prompt": [10**9]}), 400, "invalid_value", "vocabulary"),
    "body-too-large": (COMP, _j({"prompt": "x" * (BODY_LIMIT + 10)}), 413,
                       "request_too_large", "too large"),
    "stream-options-without-stream": (COMP, _j({"prompt": "hi", "stream_options": {}}), 400,
                                      "invalid_value", "stream_options"),
}


def assert_still_serves(worker: WorkerProcess) -> None:
    status, _, body = request(worker, "POST", COMP, _j({"prompt": "Hello", "max_tokens": 2,
                                                        "temperature": 0}))
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_is_refused_and_server_keeps_serving(worker: WorkerProcess, case: str) -> None:
    path, body, want_status, want_code, fragment = CASES[case]
    status, headers, raw = request(worker, "POST", path, body)
    assert status == want_status, raw
    assert headers[ENDPOINT_HEADER] == "10.1.2.3:8000"
    assert headers["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == want_code
    assert fragment in err["message"], err["message"]
    assert_still_serves(worker)


def test_context_error_says_the_numbers(worker: WorkerProcess) -> None:
    status, _, raw = request(worker, "POST", COMP, _j({"prompt": [1] * 200, "max_tokens": 100}))
    assert status == 400
    msg = json.loads(raw)["error"]["message"]
    assert all(str(n) in msg for n in (MAX_MODEL_LEN, 300, 200, 100)), msg


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/nothing-here", 404, "not_found"),
    ("POST", "/v2/completions", 404, "not_found"),
    ("GET", COMP, 405, "method_not_allowed"),
])
def test_unknown_routes_answer_json(worker: WorkerProcess, method: str, path: str, status: int,
                                    code: str) -> None:
    got, headers, raw = request(worker, method, path)
    assert got == status and headers[ENDPOINT_HEADER] == "10.1.2.3:8000"
    assert json.loads(raw)["error"]["code"] == code
    assert_still_serves(worker)


def test_streaming_request_refused_before_headers(worker: WorkerProcess) -> None:
    """A refused streaming request gets a real status, not a 200 with an error event."""
    status, _, raw = request(worker, "POST", CHAT, _j({"messages": USER, "stream": True,
                                                       "max_tokens": MAX_MODEL_LEN}))
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
