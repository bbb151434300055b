"""A stack's scale-to-zero part at start: the scaled pool's record, which the
supervisor resizes from, and the autoscaler process (the local KEDA). The pool starts
with `workers` and scales between `scale_min` and `scale_max` (default `workers`); the
workers it adds get `scale_up_args` too (a simulated pod's `--start-delay`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvyard.stack import autoscale, prestart, procs, resize
from kvyard.stack.commands import worker_cmd
from kvyard.stack.procs import Proc
from kvyard.stack.spec import StackSpec


def start_autoscaler(spec: StackSpec, run: Path, add: Callable[[Proc], Proc], scaler_port: int,
                     kv_args: list[str], kv_env_files: dict[str, str], n: int) -> dict:
    """The scaled pool's record (its worker command with `{port}` to fill in) and the
    autoscaler process, KEDA's part, started once the EPP's scaler serves."""
    if spec.disaggregated:
        raise ValueError("scale to zero runs colocated pools (--workers), not P/D")
    top = max(n, spec.scale_max or n)
    pool = resize.Pool(role="both", template=worker_cmd(spec, resize.PORT, kv_args=kv_args)
                       + spec.scale_up_args, env_files=kv_env_files,
                       min_replicas=spec.scale_min, max_replicas=top, next_index=n,
                       pool=spec.pool_name, warm=None if not spec.prestart else
                       ["aiohttp"] if spec.standin else
                       ["aiohttp", "kvyard.sim.pool"] if spec.sim else list(prestart.WORKER_WARM))
    target = autoscale.Target(spec.pool_name, "both", spec.scale_min, top, spec.idle_seconds,
                              spec.polling_seconds, spec.scale_window_s,
                              dict(spec.scaler_metadata))
    (run / autoscale.FILE).unlink(missing_ok=True)  # a previous stack's wishes are not ours
    cmd = autoscale.command(run, f"127.0.0.1:{scaler_port}", target, n)
    add(procs.spawn("autoscaler", cmd, run / "logs" / "autoscaler.log",
                    ports={"scaler": scaler_port}))
    return pool.to_json()
