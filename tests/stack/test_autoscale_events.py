"""The local autoscaler's bookkeeping, on explicit clocks: a pool that starts at N is held
there for the stabilization window; each replica change is recorded with the metric and
the backlog-only metric seen with it; extra scalerMetadata reaches the command line."""
from __future__ import annotations

from pathlib import Path

from kvyard.stack import autoscale
from kvyard.stack.autoscale import Scaler, Target


def test_a_pool_started_at_n_is_held_for_the_window() -> None:
    s = Scaler(Target("p", min_replicas=1, max_replicas=8, window_s=30), replicas=4)
    s.hold(0.0)
    assert not s.poll(True, 0.1, 1.0, 1.0) and s.replicas == 4
    assert not s.poll(True, 0.1, 1.0, 29.0) and s.replicas == 4
    assert s.poll(True, 0.1, 1.0, 31.0) and s.replicas == 1


def test_replica_changes_are_recorded_with_the_backlog_beside_the_metric() -> None:
    s = Scaler(Target("p", min_replicas=1, max_replicas=8, window_s=5), replicas=1)
    assert s.poll(True, 3.2, 1.0, 1.0, backlog=0.4) and s.replicas == 4
    assert not s.poll(True, 3.0, 1.0, 2.0, backlog=0.5)
    assert s.poll(True, 0.5, 1.0, 9.0, backlog=0.5) and s.replicas == 1
    up, down = s.events
    assert (up["from"], up["to"], up["metric"], up["backlog"], up["t"]) == (1, 4, 3.2, 0.4, 1.0)
    assert (down["from"], down["to"]) == (4, 1)
    snap = s.snapshot(10.0)
    assert snap["backlog"] == 0.5 and len(snap["events"]) == 2


def test_extra_metadata_goes_to_the_scaler_and_the_command() -> None:
    t = Target("local", extra={"signal": "backlog", "targetValue": "0.8"})
    assert t.metadata() == {"signal": "backlog", "targetValue": "0.8", "pool": "local",
                            "role": "both"}
    assert not t.explains and Target("local").explains
    cmd = autoscale.command(Path("/tmp/run"), "127.0.0.1:1", t, 2)
    assert "--metadata=signal=backlog" in cmd and "--metadata=targetValue=0.8" in cmd
