"""`kvyard up --scale-to-zero`: the autoscaler (a KEDA client of the real EPP's scaler,
kvyard.stack.autoscale) takes the pool to zero after the idle time and back to one on
StreamIsActive's `true` when a request arrives; the supervisor starts and stops the
workers; status shows it; the decisions themselves on explicit clocks."""
from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import pytest

from kvyard.stack import autoscale, procs
from kvyard.stack.autoscale import Scaler, Target
from kvyard.stack.launch import start_stack, stop_stack
from kvyard.stack.state import StackState


def workers(rd: Path) -> list:
    state = StackState.load(rd)
    return [p for p in state.procs if p.name.startswith("worker-")] if state else []


def at_zero(rd: Path) -> bool:
    doc = autoscale.read_file(rd) or {}
    return not workers(rd) and bool(doc.get("pools")) and doc["pools"][0]["replicas"] == 0


# --- decisions (pure, explicit clocks) ---------------------------------------------------

def test_push_wakes_a_pool_at_zero_and_false_is_ignored() -> None:
    s = Scaler(Target("p", min_replicas=0, max_replicas=3, cooldown_s=30), replicas=0)
    assert not s.push(False, 1.0) and s.replicas == 0
    assert s.push(True, 2.0) and s.replicas == 1 and s.reason == "woken by StreamIsActive"
    assert not s.push(True, 3.0) and s.replicas == 1  # only a pool at zero is pushed up
    assert Scaler(Target("p", min_replicas=2, max_replicas=3), 0).push(True, 0.0)


def test_polling_follows_the_metric_with_a_stabilized_scale_down() -> None:
    t = Target("p", min_replicas=0, max_replicas=4, cooldown_s=30, window_s=10)
    s = Scaler(t, replicas=1, last_active=0.0)
    assert s.poll(True, 2.5, 1.0, 1.0) and s.replicas == 3        # ceil(2.5 / 1)
    assert s.poll(True, 9.0, 1.0, 2.0) and s.replicas == 4        # clamped to the max
    assert not s.poll(True, 1.0, 1.0, 5.0) and s.replicas == 4    # recent 4s hold it
    assert s.poll(True, 1.0, 1.0, 13.0) and s.replicas == 1       # the window has passed
    assert not s.poll(True, 0.0, 1.0, 14.0) and s.replicas == 1   # active: never below 1
    # Idle: to zero only after the cooldown since the last active answer.
    assert not s.poll(False, 0.0, 1.0, 40.0) and s.replicas == 1
    assert s.poll(False, 0.0, 1.0, 44.5) and s.replicas == 0
    assert s.reason == "idle 30s (cooldown)"
    assert s.poll(True, 0.0, 1.0, 50.0) and s.replicas == 1       # the poll also wakes


def test_without_scale_to_zero_the_minimum_holds() -> None:
    s = Scaler(Target("p", min_replicas=2, max_replicas=4, cooldown_s=5), 3, last_active=0.0)
    assert s.poll(False, 0.0, 1.0, 6.0) and s.replicas == 2
    assert not s.poll(False, 0.0, 1.0, 60.0) and s.replicas == 2


# --- the stack, real processes -----------------------------------------------------------

def test_idle_pool_goes_to_zero_and_a_request_wakes_it(up, h, wait_until) -> None:
    # Polling every 3 s: the scale-down waits for a poll; the wake-up must not.
    state = up("--workers", "1", "--scale-to-zero", "--idle-seconds", "1",
               "--polling-seconds", "3")
    rd = up.run_dir
    auto = next(p for p in state.procs if p.name == "autoscaler")
    assert auto.cmd[auto.cmd.index("--scaler-address") + 1] == \
        f"127.0.0.1:{next(p for p in state.procs if p.name == 'epp').ports['scaler']}"
    wait_until(lambda: at_zero(rd), timeout=30, interval=0.1, what="the pool at zero")
    assert StackState.load(rd).endpoints == []
    # A spare interpreter waits for the next worker (kvyard up's default --prestart).
    [spare] = wait_until(lambda: [p for p in StackState.load(rd).procs if p.name == "spare"],
                         timeout=15, what="a spare")
    up.seen.add(spare.pid)
    assert "scaling down: stopping worker-0" in Path(state.supervisor.log).read_text()
    wait_until(lambda: not procs.alive(state.procs[0].pid), timeout=15, what="worker-0 gone")
    st = json.loads(h.kvyard("status", "--json", "--run-dir", str(rd)).stdout)
    assert st["endpoints"] == [] and st["autoscaler"]["workers"] == 0
    assert st["autoscaler"]["running"] and st["autoscaler"]["replicas"] == 0
    text = h.kvyard("status", "--run-dir", str(rd)).stdout
    assert "autoscaler: workers 0 (scaled to zero: a request starts one)" in text

    r = h.request(state.gateway_url, h.chat_body("wake up"), timeout=60)
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"]["content"].endswith("wake up")
    doc = autoscale.read_file(rd)
    assert doc["pools"][0]["reason"] == "woken by StreamIsActive" and doc["pushes"] >= 1
    [w] = workers(rd)
    up.seen.add(w.pid)
    assert w.name == "worker-1" and r.endpoint == f"127.0.0.1:{w.ports['http']}"
    assert w.pid == spare.pid  # the spare became the worker
    assert f"the spare became worker-1 (pid {spare.pid}" in Path(state.supervisor.log).read_text()
    assert StackState.load(rd).endpoints == [r.endpoint]
    # Idle again: back to zero, and `down` (the fixture) leaves nothing running.
    wait_until(lambda: at_zero(rd), timeout=30, interval=0.1, what="zero again")
    wait_until(lambda: not procs.alive(w.pid), timeout=15, what="worker-1 stopped")


def test_without_a_spare_a_plain_process_wakes_the_pool(up, h, wait_until) -> None:
    state = up("--workers", "1", "--scale-to-zero", "--idle-seconds", "1",
               "--polling-seconds", "3", "--no-prestart")
    rd = up.run_dir
    wait_until(lambda: at_zero(rd), timeout=30, interval=0.1, what="the pool at zero")
    # worker-0 serves until the EPP has dropped it; then it drains and exits
    wait_until(lambda: not procs.alive(state.procs[0].pid), timeout=15, what="worker-0 gone")
    r = h.request(state.gateway_url, h.chat_body("plain"), timeout=60)
    assert r.status == 200 and r.json()["choices"][0]["message"]["content"].endswith("plain")
    assert not [p for p in StackState.load(rd).procs if p.name == "spare"]
    assert "scaled up: started worker-1" in Path(state.supervisor.log).read_text()


def test_up_refuses_scale_to_zero_with_pd(h, tmp_path) -> None:
    done = h.kvyard("up", "--standin-workers", "--prefill", "1", "--decode", "1",
                    "--scale-to-zero", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and "--scale-to-zero scales colocated workers" in done.stderr


@pytest.fixture(scope="module")
def real_zero_stack(tmp_path_factory: pytest.TempPathFactory):
    """One demo-model worker that scales to zero, behind the EPP and Envoy."""
    from kvyard.common.models import ModelNotFound, demo_gguf_path
    from kvyard.stack.spec import StackSpec

    try:
        demo_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    state = start_stack(StackSpec(
        run_dir=tmp_path_factory.mktemp("zero"), workers=1, gateway_port=None,
        worker_base_port=None, epp_ports=(None, None, None), admin_port=None,
        scaler_port=None, ready_timeout_s=300.0, scale_to_zero=True, idle_seconds=2.0,
        polling_seconds=1.0))
    # No `kvyard up` here, so no supervisor: this test plays its part (resize).
    try:
        yield state
    finally:
        stop_stack(StackState.load(Path(state.run_dir)) or state)


def test_eight_concurrent_chats_at_zero_all_complete_correctly(real_zero_stack, h,
                                                                wait_until) -> None:
    from kvyard.stack.supervise import Supervisor

    state, rd = real_zero_stack, Path(real_zero_stack.run_dir)
    sup = Supervisor(rd)
    bodies = [{**h.chat_body(f"What is {i} plus {i}? Answer with a number."),
               "max_tokens": 8, "temperature": 0} for i in range(8)]

    def ask(body: dict) -> str:
        r = h.request(state.gateway_url, body, timeout=240)
        assert r.status == 200, r.body
        return r.json()["choices"][0]["message"]["content"]

    expected = [ask(b) for b in bodies]  # warm: the same greedy answers, one worker up

    def scaled(n: int) -> bool:  # the supervisor's part, as its loop plays it
        sup.scale(StackState.load(rd))
        sup.reap_drained(time.monotonic())
        return len(workers(rd)) == n and not sup.draining
    wait_until(lambda: scaled(0), timeout=60, interval=0.1, what="the pool at zero")
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(ask, b) for b in bodies]
        wait_until(lambda: scaled(1) or all(f.done() for f in futures), timeout=120,
                   interval=0.05, what="a worker started for the parked requests")
        got = [f.result(timeout=240) for f in futures]
    assert got == expected
    assert autoscale.read_file(rd)["pools"][0]["reason"] == "woken by StreamIsActive"
