"""`kvyard up --sim N` as a user runs it: the real Envoy and EPP in front of simulated pods;
and many pods in one process."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path

import aiohttp

from kvyard.stack import procs
from kvyard.stack.state import StackState


def kvyard(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _chat(gateway: str, text: str) -> tuple[int, dict, dict]:
    host, port = gateway.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
             "messages": [{"role": "user", "content": text}]}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


def test_up_sim_status_down(tmp_path: Path) -> None:
    rd = str(tmp_path / "run")
    up = kvyard("up", "--sim", "4", "--sim-profile", "h100", "--port", str(procs.free_port()),
                "--run-dir", rd)
    state = StackState.load(Path(rd))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert len(state.endpoints) == 4
        assert [p.name for p in state.procs if p.name.startswith("sim-")] == ["sim-0"]
        status, headers, body = _chat(state.gateway_url, "through Envoy and the EPP")
        assert status == 200, body
        assert headers["x-kvyard-endpoint"] in state.endpoints
        assert body["usage"]["completion_tokens"] == 4

        st = kvyard("status", "--json", "--run-dir", rd)
        assert st.returncode == 0, st.stderr
        doc = json.loads(st.stdout)
        assert sorted(e["address"] for e in doc["endpoints"]) == sorted(state.endpoints)
        assert sum(e["picks"] for e in doc["endpoints"]) >= 1
        sim = doc["sim"]
        assert sim["pods"] == 4 and sim["profile"] == "h100"
        assert sorted(a for p in sim["processes"] for a in p["pods"]) == sorted(state.endpoints)
        assert all(p["running"] for p in sim["processes"])
    finally:
        down = kvyard("down", "--run-dir", rd)
    assert down.returncode == 0, down.stderr
    assert state is None or not any(procs.alive(pid) for pid in state.pids())


async def test_64_pods_in_one_process_start_and_answer(start_pods) -> None:
    async with start_pods(64) as g, aiohttp.ClientSession() as s:
        for pod in g.pods:
            async with s.get(f"http://{pod.address}/health") as r:
                assert r.status == 200
        async with s.post(f"http://{g.pods[-1].address}/v1/completions",
                          json={"prompt": "last pod", "max_tokens": 2}) as r:
            assert r.status == 200
            assert r.headers["x-kvyard-endpoint"] == g.pods[-1].address
