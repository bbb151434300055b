"""The EPP's waiting room in a real local stack at zero (`kvyard up --scale-to-zero`, stand-in
workers): a request whose TTL runs out gets the 503 body through the gateway, and a client that
gives up while parked leaves the queue at once (the wake-up it caused still happens)."""
from __future__ import annotations

import json
import socket

from kvyard.common.wire import DROPPED_REASON_HEADER, QUEUE_TTL_HEADER
from kvyard.stack import autoscale, procs
from kvyard.stack.state import StackState


def _at_zero(rd) -> bool:
    """No worker in the stack's state and none left in the EPP's pool."""
    state = StackState.load(rd)
    doc = autoscale.read_file(rd) or {}
    if state is None or [p for p in state.procs if p.name.startswith("worker-")] \
            or not doc.get("pools") or doc["pools"][0]["replicas"] != 0:
        return False
    _, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints")
    return json.loads(body)["endpoints"] == []


def _flow(state: StackState) -> tuple[dict, dict[str, float]]:
    _, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints")
    _, text = procs.http_get(state.epp_metrics_url + "/metrics")
    outcomes = {}
    for line in text.decode().splitlines():
        if line.startswith("kvyard_epp_flow_requests_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            outcomes[outcome] = float(line.rsplit(" ", 1)[1])
    return json.loads(body)["flow"], outcomes


def test_ttl_and_disconnect_at_zero(up, h, wait_until) -> None:
    # No spare interpreter: a spare turns into a stand-in worker that is ready within the
    # 0.2 s the disconnecting client below waits, and would serve it.
    state = up("--workers", "1", "--scale-to-zero", "--idle-seconds", "1",
               "--polling-seconds", "2", "--no-prestart")
    rd = up.run_dir
    wait_until(lambda: _at_zero(rd), timeout=30, interval=0.1, what="the pool at zero")

    r = h.request(state.gateway_url, h.chat_body("too late"), headers={QUEUE_TTL_HEADER: "1"},
                  timeout=30)
    assert r.status == 503, r.body
    err = r.json()["error"]
    assert err["code"] == "rejected-no-endpoints" and err["type"] == "server_error"
    assert r.headers[DROPPED_REASON_HEADER] == "rejected-no-endpoints"
    assert int(r.headers["retry-after"]) > 0
    assert _flow(state)[1]["expired"] == 1

    # The expired request still woke the pool: let that wake-up come and go first, or the
    # next request can meet a worker that is just getting ready and be answered at once.
    wait_until(lambda: not _at_zero(rd), timeout=30, interval=0.02,
               what="the wake-up the expired request caused")
    # A client that gives up while parked (well before a worker can start).
    wait_until(lambda: _at_zero(rd), timeout=30, interval=0.1, what="zero again")
    try:
        h.request(state.gateway_url, h.chat_body("gone"), timeout=0.2)
        raise AssertionError("answered within 0.2 s at zero")
    except (TimeoutError, socket.timeout):
        pass
    wait_until(lambda: _flow(state)[1]["cancelled"] == 1, timeout=5, what="dropped")
    assert _flow(state)[0]["parked"] == 0 and _flow(state)[1]["dispatched"] == 0
    # The pool still wakes for the next request and serves it.
    r = h.request(state.gateway_url, h.chat_body("here"), timeout=60)
    assert r.status == 200 and r.json()["choices"][0]["message"]["content"].endswith("here")


def test_epp_killed_while_a_request_is_parked_fails_it_cleanly(up, h, wait_until) -> None:
    """SIGKILL the EPP while a request waits at zero: Envoy answers 503 at once (its stream
    was cut), the supervisor restarts the EPP, and the next request is served."""
    import os
    import signal
    import threading

    state = up("--workers", "1", "--scale-to-zero", "--idle-seconds", "1",
               "--polling-seconds", "2", "--no-prestart")
    rd = up.run_dir
    wait_until(lambda: _at_zero(rd), timeout=30, interval=0.1, what="the pool at zero")
    got: list = []
    t = threading.Thread(target=lambda: got.append(
        h.request(state.gateway_url, h.chat_body("parked"), timeout=30)))
    t.start()
    wait_until(lambda: _flow(state)[0]["parked"] == 1, timeout=10, interval=0.01,
               what="the request parked")
    epp = next(p for p in StackState.load(rd).procs if p.name == "epp")
    os.kill(epp.pid, signal.SIGKILL)
    t.join(10)
    assert got and got[0].status == 503, got
    assert got[0].json()["error"]["code"] == "endpoint_picker_unavailable"
    r = wait_until(lambda: (lambda x: x if x.status == 200 else None)(
        h.request(state.gateway_url, h.chat_body("again"), timeout=60)), timeout=60,
        what="served after the EPP's restart")
    assert r.json()["choices"][0]["message"]["content"].endswith("again")
