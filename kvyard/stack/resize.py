"""A scaled pool's workers, started and stopped to the replicas the autoscaler wants.

The Deployment controller's part of the local stack's scale-to-zero: the
supervisor calls `resize` when `autoscale.json` asks for another count. A new
worker gets a free port and the pool's recorded command (its `{port}` filled
in), and joins the EPP's endpoints file at once: the EPP counts an endpoint
only after a good scrape, and the worker listens only once its engine runs, so
parked requests go to it the first scrape after it is ready (50 ms), not after
another file poll. A worker to stop (the newest first) leaves the endpoints
file and the state first, so nothing restarts it, and gets SIGTERM once the EPP
has dropped it (its file poll), so nothing is routed to a closed port; then it
drains (the supervisor kills it if it outlives `DRAIN_S`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.stack import procs
from kvyard.stack.procs import Proc

log = logging.getLogger("kvyard.supervisor")
PORT = "{port}"   # in a pool's command template
LEAVE_S = 2.0     # longest wait for the EPP to drop a worker before it is stopped anyway
DRAIN_S = 40.0    # a stopped worker's drain (--shutdown-timeout 30 s) before SIGKILL


@dataclass(slots=True)
class Pool:
    """What `state.scaling` records about the scaled pool."""

    role: str
    template: list[str]
    env_files: dict[str, str] = field(default_factory=dict)
    min_replicas: int = 0
    max_replicas: int = 1
    next_index: int = 0
    pool: str = "local"
    warm: list[str] | None = None   # a spare's imports (kvyard.stack.prestart); None: no spare

    def to_json(self) -> dict:
        return {"role": self.role, "template": self.template, "env_files": self.env_files,
                "min": self.min_replicas, "max": self.max_replicas, "next": self.next_index,
                "pool": self.pool, "warm": self.warm}

    @classmethod
    def from_json(cls, d: dict) -> "Pool":
        return cls(d["role"], list(d["template"]), dict(d.get("env_files") or {}),
                   int(d.get("min", 0)), int(d.get("max", 1)), int(d.get("next", 0)),
                   str(d.get("pool", "local")), d.get("warm"))


def is_worker(p: Proc) -> bool:
    return p.name.startswith("worker-")


SPARE = "spare"


def ensure_spare(state) -> bool:
    """One spare interpreter while the pool may still grow; True when one was started."""
    if not state.scaling:
        return False
    pool = Pool.from_json(state.scaling)
    workers = sum(1 for p in state.procs if is_worker(p))
    if pool.warm is None or workers >= pool.max_replicas or \
            any(p.name == SPARE for p in state.procs):
        return False
    from kvyard.stack import prestart

    p = procs.spawn(SPARE, prestart.command(Path(state.run_dir), tuple(pool.warm)),
                    Path(state.run_dir) / "logs" / "spare.log", env_files=pool.env_files)
    state.procs.append(p)
    state.save()
    log.info("started a spare interpreter for the next worker (pid %d)", p.pid)
    return True


def _become(state, pool: Pool, name: str, cmd: list[str], log_path: Path,
            port: int) -> Proc | None:
    """The spare, told to become worker `name`; None when there is none to use."""
    from kvyard.stack import prestart

    i = next((i for i, p in enumerate(state.procs) if p.name == SPARE and procs.alive(p.pid)),
             None)
    if i is None or not prestart.can_become(cmd):
        return None
    spare = state.procs[i]
    prestart.wake(Path(state.run_dir), spare.pid, cmd, str(log_path))
    state.procs[i] = Proc(name=name, pid=spare.pid, log=str(log_path), cmd=cmd,
                          ports={"http": port}, env_files=dict(pool.env_files))
    return state.procs.pop(i)


def address(p: Proc) -> str:
    return f"127.0.0.1:{p.ports['http']}"


def endpoints(state) -> list[str]:
    return [address(p) for p in state.procs if is_worker(p)]


def _sync_endpoints(state, pool: Pool) -> None:
    from kvyard.stack.endpoints_file import write_endpoints

    state.endpoints = endpoints(state)
    write_endpoints(Path(state.run_dir) / "endpoints.yaml", state.endpoints, pool.role)


def resize(state, want: int) -> list[Proc] | None:
    """Start workers, or pick the ones to stop, until the pool has `want` (clamped to its
    bounds); saves the state. None when nothing changed, else the workers to stop (already
    out of the state and the endpoints file): the caller signals them and waits for them
    without blocking, so a wake-up during a drain is not held back by it."""
    pool = Pool.from_json(state.scaling)
    want = max(pool.min_replicas, min(pool.max_replicas, want))
    workers = [p for p in state.procs if is_worker(p)]
    if want == len(workers):
        return None
    logs = Path(state.run_dir) / "logs"
    if want > len(workers):
        taken = {port for p in state.procs for port in p.ports.values()}
        for _ in range(want - len(workers)):
            port = procs.free_port(None, taken)
            name = f"worker-{pool.next_index}"
            pool.next_index += 1
            cmd = [a.replace(PORT, str(port)) for a in pool.template]
            p = _become(state, pool, name, cmd, logs / f"{name}.log", port)
            how = "the spare became"
            if p is None:
                p, how = procs.spawn(name, cmd, logs / f"{name}.log", env_files=pool.env_files,
                                     ports={"http": port}), "started"
            state.procs.append(p)
            log.info("scaled up: %s %s (pid %d, port %d)", how, name, p.pid, port)
        state.scaling = pool.to_json()
        _sync_endpoints(state, pool)
        state.save()
        return []
    gone = workers[want:][::-1]  # the newest first
    names = {p.name for p in gone}
    state.procs = [p for p in state.procs if p.name not in names]
    _sync_endpoints(state, pool)
    state.save()  # recorded gone before stopped: never restarted behind our back
    for p in gone:
        log.info("scaling down: stopping %s (pid %d)", p.name, p.pid)
    return [p for p in gone if procs.is_ours(p)]
