"""`kvyard up` / `status --json` / `down` as a user runs them (stand-in workers)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvyard.stack import procs
from kvyard.stack.state import StackState


def kvyard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_up_status_down(tmp_path: Path, h) -> None:
    rd = str(tmp_path / "run")
    port = procs.free_port()
    up = kvyard("up", "--workers", "2", "--standin-workers", "--port", str(port), "--run-dir", rd)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"gateway: http://127.0.0.1:{port}" in up.stdout
        state = StackState.load(Path(rd))
        assert state is not None and len(state.endpoints) == 2
        assert h.request(state.gateway_url, h.chat_body("via up")).status == 200

        st = kvyard("status", "--json", "--run-dir", rd)
        assert st.returncode == 0, st.stderr
        doc = json.loads(st.stdout)
        assert doc["gateway"] == state.gateway_url
        assert sorted(e["address"] for e in doc["endpoints"]) == sorted(state.endpoints)
        for e in doc["endpoints"]:
            assert set(e) == {"address", "role", "queue", "kv_usage", "picks", "prefix_hits",
                              "kvstore", "pd"}
            assert e["pd"] is None  # stand-ins count no P/D handoffs
            assert e["kvstore"] == {"dram": {"up": True, "errors": 0},
                                    "ssd": {"up": True, "errors": 0}}
        assert sum(e["picks"] for e in doc["endpoints"]) >= 1
        assert doc["flow"]["parked"] == 0 and doc["flow"]["queued"] == 0  # nothing held

        table = kvyard("status", "--run-dir", rd)
        assert table.returncode == 0 and state.endpoints[0] in table.stdout

        again = kvyard("up", "--workers", "2", "--standin-workers", "--run-dir", rd)
        assert again.returncode == 0 and "already running" in again.stdout
        assert StackState.load(Path(rd)).pids() == state.pids()  # reused, not restarted
    finally:
        down = kvyard("down", "--run-dir", rd)
    assert down.returncode == 0, down.stderr
    assert not any(procs.alive(pid) for pid in state.pids())
    assert StackState.load(Path(rd)) is None
    assert kvyard("down", "--run-dir", rd).returncode == 0  # idempotent


def test_down_after_a_crash_stops_the_rest(tmp_path: Path) -> None:
    rd = str(tmp_path / "run")
    with socket.socket() as busy:  # the asked-for gateway port is taken: up picks another
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        up = kvyard("up", "--workers", "1", "--standin-workers", "--kv-redis",
                    "--port", str(taken), "--run-dir", rd)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = StackState.load(Path(rd))
        assert state.gateway_url != f"http://127.0.0.1:{taken}"
        redis = next(p for p in state.procs if p.name == "redis")
        worker = next(p for p in state.procs if p.name == "worker-0")
        assert f"redis://127.0.0.1:{redis.ports['redis']}" in worker.cmd
        assert procs.alive(redis.pid)
        # Redis is authenticated by default; its password file is private.
        import redis as redis_py

        with pytest.raises(redis_py.exceptions.AuthenticationError):
            redis_py.Redis(port=redis.ports["redis"], socket_timeout=5).ping()
        assert (Path(rd) / "redis.conf").stat().st_mode & 0o077 == 0
        procs.stop([worker.pid], timeout_s=2)  # a worker "crashes"
        assert kvyard("down", "--run-dir", rd).returncode == 0
        assert not any(procs.alive(pid) for pid in state.pids())
    finally:  # a failed assertion must not leak the stack into later tests
        kvyard("down", "--run-dir", rd)


def test_up_failure_tears_down_and_shows_the_log(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    up = kvyard("up", "--workers", "1", "--model", "/nonexistent/model.gguf", "--run-dir", str(rd),
                "--timeout", "60", timeout=120)
    assert up.returncode != 0
    assert "worker-0" in up.stderr
    assert StackState.load(rd) is None
