"""`kvyard status` shows each worker's kvstore tiers as up/down with error counts,
and a worker logs Redis going away once and its return once (stand-in workers run
the real store; Redis is frozen with SIGSTOP, so it stays "alive" for the
supervisor and the workers' calls time out)."""
from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path


def _touch_all(h, state) -> None:
    for a in state.endpoints:  # straight to each worker: every one must use its store
        assert h.request(f"http://{a}", h.chat_body(f"kv {uuid.uuid4()}")).status == 200


def _status(h, rd) -> dict:
    st = h.kvyard("status", "--json", "--run-dir", str(rd))
    assert st.returncode == 0, st.stderr
    return json.loads(st.stdout)


def _redis_log_lines(state, text: str) -> list[int]:
    return [Path(p.log).read_text().count(text) for p in state.procs
            if p.name.startswith("worker")]


def test_status_shows_redis_down_then_up_and_workers_log_it_once(up, h, wait_until) -> None:
    state = up("--workers", "2", "--kv-redis")
    rd = up.run_dir
    _touch_all(h, state)
    rows = _status(h, rd)["endpoints"]
    assert sorted(r["address"] for r in rows) == sorted(state.endpoints)
    for r in rows:
        assert r["kvstore"] == {"dram": {"up": True, "errors": 0},
                                "redis": {"up": True, "errors": 0}}
    redis = next(p for p in state.procs if p.name == "redis")
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        def all_down() -> bool:
            _touch_all(h, state)
            return all(not r["kvstore"]["redis"]["up"] and r["kvstore"]["redis"]["errors"] > 0
                       for r in _status(h, rd)["endpoints"])
        wait_until(all_down, timeout=30, what="every worker's redis tier down")
        for _ in range(5):
            _touch_all(h, state)
        table = h.kvyard("status", "--run-dir", str(rd)).stdout
        assert "kvstore" in table.splitlines()[1]
        assert "dram:up" in table and "redis:down(" in table, table
    finally:
        os.kill(redis.pid, signal.SIGCONT)

    def all_up() -> bool:
        _touch_all(h, state)
        return all(r["kvstore"]["redis"]["up"] for r in _status(h, rd)["endpoints"])
    wait_until(all_up, timeout=60, what="every worker's redis tier back up")
    assert _redis_log_lines(state, "kvstore tier redis (127.0.0.1") == [2, 2]  # down, back
    assert _redis_log_lines(state, " is down (") == [1, 1]
    assert _redis_log_lines(state, " is back (") == [1, 1]
