"""Parts of the stack dying: a worker (traffic moves away within a second and
comes back when it restarts) and the EPP (Envoy fails closed, fast)."""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

from kvyard.stack import procs


def _worker_proc(state, address: str):
    port = int(address.rpartition(":")[2])
    return next(p for p in state.procs if p.name.startswith("worker") and p.ports.get("http") == port)


def test_killed_worker_stops_getting_traffic_and_comes_back(own_stack, h, wait_until) -> None:
    state = own_stack(3)
    victim = state.endpoints[0]
    proc = _worker_proc(state, victim)
    procs.stop([proc.pid], timeout_s=2)
    killed_at = time.monotonic()
    # From one second after the kill, every request must succeed elsewhere.
    while time.monotonic() - killed_at < 1.0:
        h.request(state.gateway_url, h.chat_body(f"{uuid.uuid4()} during"))
    after = [h.request(state.gateway_url, h.chat_body(f"{uuid.uuid4()} after"))
             for _ in range(30)]
    assert [r.status for r in after] == [200] * 30
    assert victim not in {r.endpoint for r in after}

    restarted = procs.spawn(proc.name, proc.cmd, Path(proc.log))
    state.procs.append(restarted)  # so the fixture stops it too
    wait_until(lambda: procs.http_ok(f"http://{victim}/health"), timeout=30, what="restart")

    def lands_on_victim() -> bool:
        r = h.request(state.gateway_url, h.chat_body(f"{uuid.uuid4()} back"))
        assert r.status == 200
        return r.endpoint == victim

    wait_until(lands_on_victim, timeout=10, interval=0.0, what="traffic on the restarted worker")


def test_worker_killed_under_load_costs_no_request(own_stack, h, wait_until) -> None:
    """The EPP lists fallbacks after its pick and the gateway retries on them, so
    requests decided for a worker that dies before it answers still succeed."""
    state = own_stack(3)
    proc = _worker_proc(state, state.endpoints[0])
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            statuses.append(h.request(state.gateway_url, h.chat_body(f"{uuid.uuid4()}")).status)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(statuses) >= 40, timeout=30, what="load before the kill")
        os.killpg(proc.pid, signal.SIGKILL)
        at_kill = len(statuses)
        wait_until(lambda: len(statuses) >= at_kill + 80, timeout=30, what="load after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert statuses.count(200) == len(statuses), [s for s in statuses if s != 200]


def test_epp_down_gives_a_fast_clean_5xx(own_stack, h) -> None:
    state = own_stack(1)
    assert h.request(state.gateway_url, h.chat_body("before")).status == 200
    epp = next(p for p in state.procs if p.name == "epp")
    procs.stop([epp.pid], timeout_s=2)
    for i in range(3):
        r = h.request(state.gateway_url, h.chat_body(f"without epp {i}"), timeout=10)
        assert 500 <= r.status < 600
        assert r.seconds < 2.0
