"""`kvyard up --sim N --model alpha=demo --model beta=demo`: every model's pool publishes its
KV events on ports of its own, the endpoints file names them beside each pool, the EPP
subscribes to all of them, and a request is matched only against its own model's pods."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kvyard.stack import procs
from kvyard.stack.state import StackState


def _kvyard(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _completion(gateway: str, model: str, prompt: str) -> str:
    host, port = gateway.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": model, "prompt": prompt, "max_tokens": 2}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = r.read()
        assert r.status == 200, body
        return r.getheader("x-kvyard-endpoint")
    finally:
        conn.close()


def _per_endpoint(state: StackState) -> dict[str, int]:
    code, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints", 5.0)
    assert code == 200
    return json.loads(body)["kv_events"]["index"]["per_endpoint"]


def _wait_indexed(state: StackState, address: str, blocks: int = 10) -> dict[str, int]:
    deadline = time.monotonic() + 30
    while (per := _per_endpoint(state)).get(address, 0) < blocks:
        assert time.monotonic() < deadline, per
        time.sleep(0.1)
    return per


def test_every_model_pool_publishes_and_routes_precisely(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    up = _kvyard("up", "--sim", "2", "--model", "alpha=demo", "--model", "beta=demo",
                 "--sim-profile", "h200", "--port", str(procs.free_port()), "--run-dir", str(rd))
    state = StackState.load(rd)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        rows = yaml.safe_load((rd / "endpoints.yaml").read_text())
        pools = {p: {r["address"] for r in rows if r["pool"] == p} for p in ("alpha", "beta")}
        assert [len(m) for m in pools.values()] == [2, 2]
        assert len({r["kv_events"] for r in rows}) == 4
        assert len({r["kv_events_replay"] for r in rows}) == 4
        code, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints", 5.0)
        streams = json.loads(body)["kv_events"]["streams"]
        assert sorted(s["endpoint"] for s in streams) == sorted(r["kv_events"] for r in rows)

        doc = "a document both models are asked about " * 40
        a = _completion(state.gateway_url, "alpha", doc + "first")
        assert a in pools["alpha"]
        _wait_indexed(state, a)
        # alpha holds the prompt, beta nothing: beta's request stays in beta's pool, and its
        # pod's own events (not alpha's blocks) make the later ones stick to it
        b = _completion(state.gateway_url, "beta", doc + "first")
        assert b in pools["beta"]
        per = _wait_indexed(state, b)
        assert set(per) == {a, b}
        for q in ("second", "third", "fourth"):
            assert _completion(state.gateway_url, "beta", doc + q) == b
            assert _completion(state.gateway_url, "alpha", doc + q) == a
    finally:
        down = _kvyard("down", "--run-dir", str(rd))
    assert down.returncode == 0, down.stderr
