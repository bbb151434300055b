"""`kvyard up` wires precise prefix routing by default: every worker publishes its KV
events on ports of its own, the EPP's endpoints file names them, and the EPP's default
config (precise-prefix-cache) subscribes and routes by what each engine holds."""
from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kvyard.common.kv_events import KVEventsConfig
from kvyard.stack import procs
from kvyard.stack.kv_events import EventPorts, wanted
from kvyard.stack.spec import StackSpec
from kvyard.stack.state import StackState


def test_each_worker_gets_its_own_publisher_flag_the_worker_parses(tmp_path: Path) -> None:
    from kvyard.workers.server.cli import add_arguments

    ports = EventPorts.allocate(3, set())
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfgs = [p.parse_args(["--model", "demo", *ports.flag(i)]).kv_events_config for i in range(3)]
    assert [c.endpoint for c in cfgs] == [f"tcp://*:{ports.pub + i}" for i in range(3)]
    assert [c.replay_endpoint for c in cfgs] == [f"tcp://*:{ports.replay + i}" for i in range(3)]
    assert all(isinstance(c, KVEventsConfig) and c.active for c in cfgs)
    streams = ports.streams(["127.0.0.1:1", "127.0.0.1:2"])
    assert streams["127.0.0.1:2"] == (f"tcp://127.0.0.1:{ports.pub + 1}",
                                      f"tcp://127.0.0.1:{ports.replay + 1}")
    spec = StackSpec(run_dir=tmp_path)
    assert wanted(spec)
    for off in ({"kv_events": False}, {"standin": True}, {"scale_to_zero": True},
                {"sim": 2, "sim_args": ["--zmq-endpoint", "tcp://*:5557"]}):
        assert not wanted(StackSpec(run_dir=tmp_path, **off)), off


def _kvyard(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _completion(gateway: str, prompt: str) -> str:
    host, port = gateway.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": prompt, "max_tokens": 2}), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        return r.getheader("x-kvyard-endpoint")
    finally:
        conn.close()


def _debug(state: StackState) -> dict:
    code, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints", 5.0)
    assert code == 200
    return json.loads(body)


def test_up_sim_routes_by_the_pods_kv_events(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    up = _kvyard("up", "--sim", "3", "--sim-profile", "h200", "--port", str(procs.free_port()),
                 "--run-dir", str(rd))
    state = StackState.load(rd)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        rows = yaml.safe_load((rd / "endpoints.yaml").read_text())
        assert sorted(r["address"] for r in rows) == sorted(state.endpoints)
        assert len({r["kv_events"] for r in rows}) == 3 and all(r["kv_events_replay"]
                                                               for r in rows)
        streams = _debug(state)["kv_events"]["streams"]
        assert sorted(s["endpoint"] for s in streams) == sorted(r["kv_events"] for r in rows)

        doc = "a long shared document " * 60
        first = _completion(state.gateway_url, doc + "first question")
        deadline = time.monotonic() + 30
        while True:  # the pod's BlockStored events reach the EPP's index
            index = _debug(state)["kv_events"]["index"]
            if index["per_endpoint"].get(first, 0) >= 10:
                break
            assert time.monotonic() < deadline, index
            time.sleep(0.1)
        assert set(index["per_endpoint"]) == {first} and index["stored"] >= 10
        for q in ("second", "third", "fourth"):
            assert _completion(state.gateway_url, doc + q) == first
    finally:
        down = _kvyard("down", "--run-dir", str(rd))
    assert down.returncode == 0, down.stderr


def test_up_sim_without_kv_events_names_no_streams(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    up = _kvyard("up", "--sim", "2", "--no-kv-events", "--port", str(procs.free_port()),
                 "--run-dir", str(rd))
    state = StackState.load(rd)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        rows = yaml.safe_load((rd / "endpoints.yaml").read_text())
        assert len(rows) == 2 and not any("kv_events" in r for r in rows)
        assert _debug(state)["kv_events"]["streams"] == []
        doc = "another shared document " * 60  # still prefix-routed, by the EPP's own picks
        first = _completion(state.gateway_url, doc + "one")
        assert _completion(state.gateway_url, doc + "two") == first
    finally:
        assert _kvyard("down", "--run-dir", str(rd)).returncode == 0


def test_a_real_workers_kv_events_reach_the_epps_index(real_stack: StackState) -> None:
    """The real engine publishes (one worker, kvyard up's default) and the EPP indexes it."""
    [row] = yaml.safe_load((Path(real_stack.run_dir) / "endpoints.yaml").read_text())
    assert row["kv_events"].startswith("tcp://127.0.0.1:") and row["kv_events_replay"]
    [stream] = _debug(real_stack)["kv_events"]["streams"]
    assert stream["endpoint"] == row["kv_events"]
    _completion(real_stack.gateway_url, "a real prompt of several full blocks " * 12)
    deadline = time.monotonic() + 60
    while (n := _debug(real_stack)["kv_events"]["index"]["per_endpoint"]
           .get(row["address"], 0)) < 4:
        assert time.monotonic() < deadline, n
        time.sleep(0.1)
