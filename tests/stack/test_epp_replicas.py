"""Active-active EPP replicas in a real local stack: `kvyard up --sim 4 --epp-replicas 2`
serves through Envoy and `kvyard status --json` lists both EPPs; SIGKILLing one EPP
under load costs no request (Envoy health-checks the replicas and retries an ext_proc
stream that failed on the dead one on the other)."""
from __future__ import annotations

import json
import os
import signal
import threading
import uuid
from pathlib import Path

from kvyard.stack import procs
from kvyard.stack.launch import start_stack, stop_stack
from kvyard.stack.state import StackState

from .conftest import make_spec


def test_up_sim_with_two_epp_replicas_serves_and_status_lists_both(tmp_path: Path, h) -> None:
    rd = tmp_path / "run"
    done = h.kvyard("up", "--sim", "4", "--epp-replicas", "2", "--port", str(procs.free_port()),
                    "--run-dir", str(rd))
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        state = StackState.load(rd)
        assert [p.name for p in state.procs if p.name.startswith("epp")] == ["epp", "epp-1"]
        for i in range(6):
            r = h.request(state.gateway_url, h.chat_body(f"replicas {i}"), timeout=30)
            assert r.status == 200, r.body
        st = h.kvyard("status", "--json", "--run-dir", str(rd))
        assert st.returncode == 0, st.stderr
        epps = json.loads(st.stdout)["epps"]
        assert [e["name"] for e in epps] == ["epp", "epp-1"]
        assert all(e["running"] and e["answers"] and e["replicas"]["caught_up"] for e in epps)
        assert sum(e["replicas"]["sent"] for e in epps) >= 6  # every pick was shared
    finally:
        down = h.kvyard("down", "--run-dir", str(rd))
        assert down.returncode == 0, down.stdout + down.stderr


def test_an_epp_replica_killed_under_load_costs_no_request(tmp_path: Path, h,
                                                           wait_until) -> None:
    spec = make_spec(tmp_path / "s", 3)
    spec.epp_replicas = 2
    state = start_stack(spec)
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            r = h.request(state.gateway_url, h.chat_body(f"{uuid.uuid4()}"))
            statuses.append(r.status)

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(statuses) >= 40, timeout=30, what="load before the kill")
        victim = next(p for p in state.procs if p.name == "epp-1")
        os.killpg(victim.pid, signal.SIGKILL)
        at_kill = len(statuses)
        wait_until(lambda: len(statuses) >= at_kill + 80, timeout=30, what="load after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        stop_stack(state)
    assert statuses.count(200) == len(statuses), [s for s in statuses if s != 200]
