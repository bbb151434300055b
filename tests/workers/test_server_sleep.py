"""Sleep mode on a real worker (`--enable-sleep-mode`, demo model, CPU): vLLM's routes,
the 503 while asleep, /health, the gauge, and greedy output identical after each wake."""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvyard.common.wire import M_SLEEPING
from kvyard.workers.server.testing import WorkerProcess, start_worker

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory: pytest.TempPathFactory, demo_gguf: Path) -> Iterator[WorkerProcess]:
    assert demo_gguf.is_file()
    log = tmp_path_factory.mktemp("sleepy") / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len", "1024",
                      "--kv-cache-memory-bytes", "64MiB", "--num-threads", "1",
                      "--enable-sleep-mode"], log, env=env)
    yield w
    assert w.stop() == 0, f"worker did not shut down cleanly:\n{w.log_tail()}"


def _call(w: WorkerProcess, method: str, path: str, body: Any = None,
          timeout: float = 120) -> tuple[int, dict, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(w.base_url + path, data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, headers = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, dict(e.headers)
    try:
        return status, headers, json.loads(raw)
    except ValueError:
        return status, headers, raw.decode(errors="replace")


def _greedy(w: WorkerProcess, max_tokens: int = 24) -> list[str]:
    st, _, body = _call(w, "POST", "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                         "logprobs": 0})
    assert st == 200, body
    return body["choices"][0]["logprobs"]["tokens"]


def _gauge(w: WorkerProcess) -> float:
    _, _, text = _call(w, "GET", "/metrics")
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(M_SLEEPING)]
    assert len(vals) == 1, text
    return vals[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_gives_the_same_greedy_tokens(sleepy: WorkerProcess, level: int):
    before = _greedy(sleepy)
    assert _call(sleepy, "GET", "/is_sleeping")[2] == {"is_sleeping": False}
    assert _gauge(sleepy) == 0.0
    st, _, body = _call(sleepy, "POST", f"/sleep?level={level}")
    assert st == 200, body
    assert _call(sleepy, "GET", "/is_sleeping")[2] == {"is_sleeping": True}
    st, _, health = _call(sleepy, "GET", "/health")
    assert st == 200 and health["sleeping"] is True and health["level"] == level, health
    assert _gauge(sleepy) == 1.0
    t0 = time.monotonic()
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "stream": True})):
        st, headers, err = _call(sleepy, "POST", path, body, timeout=10)
        assert st == 503, err
        assert err["error"]["code"] == "model_sleeping" and err["error"]["type"], err
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert int(headers.get("Retry-After", headers.get("retry-after"))) > 0
    assert time.monotonic() - t0 < 5.0   # refused at once, not queued
    st, _, body = _call(sleepy, "POST", "/wake_up")
    assert st == 200 and body == {"is_sleeping": False}, body
    assert _call(sleepy, "GET", "/is_sleeping")[2] == {"is_sleeping": False}
    st, _, health = _call(sleepy, "GET", "/health")
    assert st == 200 and health["sleeping"] is False and health["status"] == "ok", health
    assert _gauge(sleepy) == 0.0
    assert _greedy(sleepy) == before     # token for token, the prefix cache gone meanwhile


def test_bad_level_is_400_and_wake_when_awake_is_fine(sleepy: WorkerProcess):
    st, _, err = _call(sleepy, "POST", "/sleep?level=3")
    assert st == 400 and err["error"]["code"], err
    assert _call(sleepy, "GET", "/is_sleeping")[2] == {"is_sleeping": False}
    assert _call(sleepy, "POST", "/wake_up")[0] == 200


def test_in_flight_request_is_drained_before_sleep(sleepy: WorkerProcess):
    """A request running when /sleep arrives finishes normally; /sleep answers after it."""
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["r"] = _call(sleepy, "POST", "/v1/completions",
                            {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True,
                             "temperature": 0})

    th = threading.Thread(target=long_request)
    th.start()
    deadline = time.monotonic() + 60
    while "vllm:num_requests_running{" not in _running_line(sleepy):   # poll under a deadline
        assert time.monotonic() < deadline, "the request never started"
    st, _, _ = _call(sleepy, "POST", "/sleep?level=1")
    assert st == 200
    th.join(120)
    st, _, body = result["r"]
    assert st == 200 and body["usage"]["completion_tokens"] == 64, body
    assert _call(sleepy, "POST", "/wake_up")[0] == 200
    assert len(_greedy(sleepy, 4)) == 4


def _running_line(w: WorkerProcess) -> str:
    _, _, text = _call(w, "GET", "/metrics")
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("vllm:num_requests_running{") and not line.endswith(" 0.0"))


def test_routes_absent_without_the_flag(worker: WorkerProcess):
    for method, path in (("POST", "/sleep?level=1"), ("POST", "/wake_up"),
                         ("GET", "/is_sleeping")):
        assert _call(worker, method, path)[0] == 404
    text = _call(worker, "GET", "/metrics")[2]
    assert M_SLEEPING not in text
