"""`kvyard up` supervises what it starts: a killed EPP, Envoy, worker or Redis is
started again with the same command, ports and environment, the state file gets
the new pid, the supervisor's log the exit status; `down` stops the supervisor
first and leaves nothing running. Backoff is checked on explicit clocks."""
from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import redis as redis_py

from kvyard.stack import procs, supervise
from kvyard.stack.state import StackState
from kvyard.stack.supervise import Backoff, Supervisor


def _proc(state: StackState, name: str):
    return next(p for p in state.procs if p.name == name)


def _restarted(rd: Path, name: str, old_pid: int):
    """The state file's record of `name` once the supervisor restarted it, else None."""
    state = StackState.load(rd)
    p = _proc(state, name)
    return p if p.pid != old_pid and procs.alive(p.pid) else None


def _gateway_ok(h, state: StackState) -> bool:
    return h.request(state.gateway_url, h.chat_body(f"back {uuid.uuid4()}")).status == 200


def _sup_log(state: StackState) -> str:
    return Path(state.supervisor.log).read_text()


def test_a_killed_epp_is_restarted_and_the_gateway_serves_again(up, h, wait_until) -> None:
    state = up("--workers", "1")
    assert state.supervisor is not None and procs.is_ours(state.supervisor)
    assert state.supervisor.cmd == supervise.command(up.run_dir)
    assert _gateway_ok(h, state)
    epp = _proc(state, "epp")
    os.kill(epp.pid, signal.SIGKILL)
    new = wait_until(lambda: _restarted(up.run_dir, "epp", epp.pid), timeout=30,
                     what="a new EPP pid in the state file")
    up.seen.add(new.pid)
    assert (new.cmd, new.ports, new.restarts) == (epp.cmd, epp.ports, 1)
    wait_until(lambda: _gateway_ok(h, state), timeout=60, interval=0.1,
               what="a request through the gateway after the EPP's restart")
    log = _sup_log(state)
    assert f"epp (pid {epp.pid}) died: killed by SIGKILL" in log
    assert f"restarted epp: pid {new.pid}" in log
    st = h.kvyard("status", "--json", "--run-dir", str(up.run_dir))
    sup = json.loads(st.stdout)["supervisor"]
    assert sup["running"] and sup["pid"] == state.supervisor.pid
    assert sup["restarts"] == {"epp": {"count": 1, "last_exit": "killed by SIGKILL"}}
    assert "epp 1x (last: killed by SIGKILL)" in h.kvyard("status", "--run-dir",
                                                           str(up.run_dir)).stdout


def test_envoy_a_worker_and_redis_are_restarted_on_their_ports(up, h, wait_until) -> None:
    state = up("--workers", "2", "--kv-redis")
    rd = up.run_dir
    envoy = _proc(state, "envoy")
    os.kill(envoy.pid, signal.SIGKILL)
    new = wait_until(lambda: _restarted(rd, "envoy", envoy.pid), timeout=30, what="new Envoy")
    up.seen.add(new.pid)
    assert new.ports == envoy.ports
    wait_until(lambda: _gateway_ok(h, state), timeout=30, interval=0.1, what="Envoy serving")

    worker = _proc(state, "worker-0")
    os.kill(worker.pid, signal.SIGKILL)
    new = wait_until(lambda: _restarted(rd, "worker-0", worker.pid), timeout=30,
                     what="new worker-0")
    up.seen.add(new.pid)
    assert new.cmd == worker.cmd and new.env_files == worker.env_files
    address = state.endpoints[0]
    wait_until(lambda: procs.http_ok(f"http://{address}/health"), timeout=30,
               what="worker-0 on its old port")

    rproc = _proc(state, "redis")
    os.kill(rproc.pid, signal.SIGKILL)
    new = wait_until(lambda: _restarted(rd, "redis", rproc.pid), timeout=30, what="new redis")
    up.seen.add(new.pid)
    password = (rd / "redis.password").read_text().strip()
    client = redis_py.Redis(port=rproc.ports["redis"], password=password, socket_timeout=2)
    try:
        wait_until(client.ping, timeout=30, what="the restarted redis answering, same password")
    finally:
        client.close()

    def worker_uses_redis_again() -> bool:  # the restarted worker got the password from its file
        r = h.request(f"http://{address}", h.chat_body(f"kv {uuid.uuid4()}"))
        st = json.loads(h.kvyard("status", "--json", "--run-dir", str(rd)).stdout)
        row = next(e for e in st["endpoints"] if e["address"] == address)
        return r.status == 200 and row["kvstore"]["redis"]["up"] \
            and row["kvstore"]["redis"]["errors"] == 0
    wait_until(worker_uses_redis_again, timeout=60, interval=0.2, what="worker-0 on redis")
    assert _gateway_ok(h, state)
    restarts = {p.name: p.restarts for p in StackState.load(rd).procs}
    assert restarts == {"redis": 1, "worker-0": 1, "worker-1": 0, "epp": 0, "envoy": 1}


def test_down_stops_the_supervisor_first_and_leaves_nothing(up, h) -> None:
    state = up("--workers", "1")
    pids = h.every_pid(state)
    assert len(pids) == 4  # worker, EPP, Envoy, supervisor
    down = h.kvyard("down", "--run-dir", str(up.run_dir))
    assert down.returncode == 0 and "stopped 4 process(es)" in down.stdout
    assert not [p for p in pids if procs.alive(p)]
    log = _sup_log(state)
    assert log.rstrip().endswith("left to `kvyard down`")
    assert "died" not in log and "restarted" not in log  # it restarted nothing down stopped
    assert StackState.load(up.run_dir) is None


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_minute() -> None:
    b = Backoff(started=0.0)
    waits = [b.crashed(1.0) for _ in range(9)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    b.started = 100.0
    assert b.crashed(100.0 + supervise.STABLE_S) == 0.5
    b.started = 161.0  # restarted, then dead again within the minute: doubling again
    assert b.crashed(162.0) == 1.0


def test_tick_restarts_on_schedule_with_the_environment_from_files(tmp_path, wait_until):
    """A process that exits at once: each death is noticed with its status and it is
    started again when due, with its environment re-read from its file."""
    code = tmp_path / "code"
    code.write_text("3")
    cmd = [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['KV_TEST_CODE']))"]
    p = procs.spawn("crasher", cmd, tmp_path / "crasher.log", env_files={"KV_TEST_CODE": str(code)})
    state = StackState(run_dir=str(tmp_path), gateway_url="", admin_url="", epp_metrics_url="",
                       endpoints=[], procs=[p])
    sup = Supervisor(tmp_path)
    t = 1000.0
    wait_until(lambda: sup.tick(state, t), timeout=30, what="the first death noticed")
    assert state.procs[0].last_exit == "exit status 3" and state.procs[0].pid == p.pid
    assert not sup.tick(state, t + 0.49)  # not due yet
    code.write_text("4")
    assert sup.tick(state, t + 0.5)
    first = state.procs[0]
    assert first.pid != p.pid and first.restarts == 1 and first.cmd == cmd
    wait_until(lambda: sup.tick(state, t + 1.0), timeout=30, what="the second death")
    assert state.procs[0].last_exit == "exit status 4"  # the new value from the file
    assert not sup.tick(state, t + 1.99)  # the delay doubled: due at t + 1.0 + 1.0
    assert sup.tick(state, t + 2.0) and state.procs[0].restarts == 2
    wait_until(lambda: sup.tick(state, t + 3.0), timeout=30, what="the third death")
    assert state.procs[0].restarts == 2
    assert state.procs[0].env_files == {"KV_TEST_CODE": str(code)}  # a path, not the value
