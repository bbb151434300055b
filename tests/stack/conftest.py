"""A real local stack for end-to-end tests: Envoy, the EPP process and stand-in
workers, all on free loopback ports, started through the same code as `kvyard up`."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

import pytest

from kvyard.stack import procs
from kvyard.stack.launch import start_stack, stop_stack
from kvyard.stack.spec import StackSpec
from kvyard.stack.state import StackState


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    @property
    def endpoint(self) -> str | None:
        return self.headers.get("x-kvyard-endpoint")

    def json(self) -> dict:
        return json.loads(self.body)


def request(url: str, body: bytes | dict, headers: dict[str, str] | None = None,
            path: str = "/v1/chat/completions", timeout: float = 10.0) -> Reply:
    """One POST over a fresh loopback connection; the whole body is read."""
    u = urlsplit(url)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=raw,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, data,
                     time.monotonic() - t0)
    finally:
        conn.close()


def chat_body(user: str, system: str | None = None, stream: bool = False) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user}]
    return {"model": "SmolLM2-135M-Instruct", "messages": msgs, "max_tokens": 4, "stream": stream}


def make_spec(run_dir: Path, workers: int, standin_args: list[str] | None = None) -> StackSpec:
    return StackSpec(run_dir=run_dir, workers=workers, standin=True, gateway_port=None,
                     worker_base_port=None, epp_ports=(None, None, None), admin_port=None,
                     scaler_port=None, ready_timeout_s=90.0, standin_args=standin_args or [])


def epp_rows(state: StackState) -> dict[str, dict]:
    code, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints")
    assert code == 200
    doc = json.loads(body)
    rows = doc.get("endpoints", doc) if isinstance(doc, dict) else doc
    return {r["address"]: r for r in rows}


def set_queue(address: str, waiting: int) -> None:
    h, _, p = address.rpartition(":")
    r = request(f"http://{h}:{p}", {"waiting": waiting}, path="/standin/queue")
    assert r.status == 200


def served(address: str) -> int:
    code, body = procs.http_get(f"http://{address}/standin/stats")
    assert code == 200
    return json.loads(body)["served"]


@pytest.fixture(scope="module")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    """One real demo-model worker behind the EPP and Envoy, per module (skips without
    the model; loading is slow on CPU)."""
    from kvyard.common.models import ModelNotFound, demo_gguf_path
    try:
        demo_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    state = start_stack(StackSpec(run_dir=tmp_path_factory.mktemp("real"), workers=1,
                                  gateway_port=None, worker_base_port=None,
                                  epp_ports=(None, None, None), admin_port=None,
                                  scaler_port=None, ready_timeout_s=300.0))
    try:
        yield state
    finally:
        stop_stack(state)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    """Three stand-ins behind one EPP and one Envoy, shared by a module's tests
    (each test leaves queue depths as it found them)."""
    state = start_stack(make_spec(tmp_path_factory.mktemp("stack"), 3))
    try:
        yield state
    finally:
        stop_stack(state)


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Callable[[int], StackState]]:
    """A private stack for tests that kill parts of it."""
    states: list[StackState] = []

    def start(workers: int = 2, standin_args: list[str] | None = None) -> StackState:
        states.append(start_stack(make_spec(tmp_path / f"s{len(states)}", workers, standin_args)))
        return states[-1]

    try:
        yield start
    finally:
        for s in states:
            stop_stack(s)


def kvyard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The `kvyard` command as a user runs it."""
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def every_pid(state: StackState | None) -> list[int]:
    """Every process a state file names, the supervisor included."""
    if state is None:
        return []
    sup = getattr(state, "supervisor", None)
    return state.pids() + ([sup.pid] if sup else [])


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Callable[..., StackState]]:
    """`kvyard up --standin-workers ARGS` in a private run dir; `kvyard down` at the end,
    and then no process any state file of the test named may be left running."""
    rd = tmp_path / "run"
    seen: set[int] = set()

    def start(*args: str) -> StackState:
        done = kvyard("up", "--standin-workers", "--port", str(procs.free_port()),
                      "--run-dir", str(rd), *args)
        assert done.returncode == 0, done.stdout + done.stderr
        state = StackState.load(rd)
        seen.update(every_pid(state))
        return state

    start.run_dir = rd  # type: ignore[attr-defined]
    start.seen = seen  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        seen.update(every_pid(StackState.load(rd)))
        down = kvyard("down", "--run-dir", str(rd))
        assert down.returncode == 0, down.stdout + down.stderr
        left = [p for p in seen if procs.alive(p)]
        procs.stop(left, timeout_s=2)
        assert not left, f"left running after down: {left}"


def envoy_validates(text: str, where: Path) -> None:
    """The bootstrap `text` passes `envoy --mode validate`."""
    from kvyard.gateway.envoy import envoy_binary

    conf = where / "envoy.yaml"
    conf.write_text(text)
    out = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(conf)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def signal_under_load(state: StackState, victim: str, sig: int, clients: int, wait_until,
                      timeout: float = 10.0, bodies: list | None = None) -> tuple[float, list[tuple[float, int]]]:
    """`clients` closed-loop chat clients on the gateway; `sig` to the `victim` process
    group after 40 requests, then 80 more. (signal time, [(start, status)]); `bodies`, if
    given, collects (start, status, body) of every reply but a 200, for a failure's message."""
    import os
    import threading
    import uuid

    results: list[tuple[float, int]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            r = request(state.gateway_url, chat_body(f"{uuid.uuid4()}"), timeout=timeout)
            results.append((t0, r.status))
            if bodies is not None and r.status != 200:
                bodies.append((t0, r.status, r.body[:300]))

    threads = [threading.Thread(target=load) for _ in range(clients)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(results) >= 40, timeout=30, what="load before the signal")
        proc = next(p for p in state.procs if p.name == victim)
        signalled_at = time.monotonic()
        os.killpg(proc.pid, sig)
        at = len(results)
        wait_until(lambda: len(results) >= at + 80, timeout=30, what="load after the signal")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        stop_stack(state)
    return signalled_at, results


@pytest.fixture
def h():
    """The helpers above, for test modules (which cannot import conftest)."""
    import types

    return types.SimpleNamespace(request=request, chat_body=chat_body, epp_rows=epp_rows,
                                 set_queue=set_queue, served=served, kvyard=kvyard,
                                 every_pid=every_pid, signal_under_load=signal_under_load)
