"""`kvyard up --sim N`: N simulated pods (kvyard.sim) instead of workers, behind the real
Envoy and EPP.

The pods run in a few `kvyard sim serve` processes (`sim-0`, `sim-1`, ...), up to
`PODS_PER_PROCESS` each: one interpreter per pod would need ~50 MB and a tokenizer load
apiece, which 256 pods on a small box cannot afford; one event loop serves a hundred idle
pods for nothing. Each pod keeps its own port, so the EPP, `kvyard status` and the gateway
see N separate endpoints; the supervisor restarts a whole process (its pods) if it dies.
With --scale-to-zero the scaled workers are one-pod sim processes (`worker_cmd`), so the
autoscaler's start and stop work unchanged.

The EPP scrapes every endpoint every 50 ms by default; at hundreds of pods on two cores
that alone would saturate them, so the scrape interval grows with the pool (`epp_args`).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable

from kvyard.stack import procs
from kvyard.stack.procs import Proc
from kvyard.stack.readiness import ready_check
from kvyard.stack.spec import StackSpec

PODS_PER_PROCESS = 128
SIM_PREFIX = "sim-"
SIM_MODULE = "kvyard.sim.cli"


def _sim_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", SIM_MODULE, *args]


def sim_args(spec: StackSpec) -> list[str]:
    """The flags every simulated pod of the stack shares."""
    return ["--model", spec.model, "--profile", spec.sim_profile,
            "--kv-cache-size", str(spec.sim_kv_cache_size), *spec.sim_args]


def pod_cmd(spec: StackSpec, port: int | str, role: str, pd_key: Path | None) -> list[str]:
    """One pod in a process of its own (scale-to-zero's workers)."""
    return _sim_cmd("serve", "--port", str(port), "--advertise-address",
                     f"127.0.0.1:{port}", "--role", role,
                     *(["--pd-key-file", str(pd_key)] if pd_key else []), *sim_args(spec))


def epp_args(n: int) -> list[str]:
    """A scrape interval of 2 ms per pod, at least the EPP's 50 ms (0.5 s at 256 pods);
    metrics count as stale after 4 intervals (at least the EPP's 2 s)."""
    interval = max(0.05, 0.002 * n)
    return ["--scrape-interval", f"{interval:g}", "--stale-after", f"{max(2.0, 4 * interval):g}"]


def spawn_sim_pods(spec: StackSpec, roles: list[str], taken: set[int], logs: Path,
                   pd_key: Path | None, add: Callable[[Proc], Proc],
                   name_prefix: str = SIM_PREFIX, extra: list[str] | None = None
                   ) -> tuple[list[str], list[tuple[Proc, Callable[[], bool]]]]:
    """Start the sim processes (`extra`: more flags for each, e.g. the KV-event ports,
    which each pod offsets by its index); the pods' addresses (in `roles` order) and
    readiness checks."""
    base = spec.worker_base_port
    ports = [procs.free_port(None if base is None else base + i, taken) for i in range(len(roles))]
    n_procs = max(1, math.ceil(len(ports) / PODS_PER_PROCESS))
    per = math.ceil(len(ports) / n_procs)
    checks: list[tuple[Proc, Callable[[], bool]]] = []
    for k in range(n_procs):
        mine = list(range(k * per, min(len(ports), (k + 1) * per)))
        if not mine:
            continue
        cmd = _sim_cmd("serve", "--first-pod", str(mine[0]),
                       "--ports", ",".join(str(ports[i]) for i in mine),
                        "--roles", ",".join(roles[i] for i in mine),
                        *(["--pd-key-file", str(pd_key)] if pd_key else []), *sim_args(spec),
                        *(extra or []))
        name = f"{name_prefix}{k}"
        p = add(procs.spawn(name, cmd, logs / f"{name}.log",
                            ports={f"pod-{i}": ports[i] for i in mine}))
        checks += [(p, ready_check(f"http://127.0.0.1:{ports[i]}/health")) for i in mine]
    return [f"127.0.0.1:{p}" for p in ports], checks


def sim_view(state) -> dict | None:
    """`kvyard status --json`'s "sim": the profile and each sim process with its pods."""
    spec = state.spec or {}
    if not spec.get("sim"):
        return None
    rows = [{"name": p.name, "pid": p.pid, "running": procs.is_ours(p),
             "pods": [f"127.0.0.1:{port}" for port in p.ports.values()]}
            for p in state.procs if SIM_MODULE in p.cmd]  # scale to zero: one-pod workers
    return {"pods": spec.get("sim"), "profile": spec.get("sim_profile"),
            "kv_cache_size": spec.get("sim_kv_cache_size"), "processes": rows}
