"""`python -m kvyard.stack.prestart --run-dir DIR --warm M,...`: a spare interpreter that
becomes the next worker of a pool scaled to zero.

Importing torch and the worker's modules is most of a worker's start on a small model
(bench coldstart: ~1.5-2.5 s of ~3 s), and none of it depends on the request. So while
the pool is below its max, the supervisor keeps one spare: a process that has done
those imports, holds no model, no KV cache and no port, and waits. On a scale-up the
supervisor writes the worker's command to `spares/<pid>.json` and sends SIGWINCH; the
spare points its output at the worker's log and runs the command's module in place
(`runpy`, as `python -m` would), so it *is* the worker, with the pid the supervisor
recorded. No fork after torch's import (nothing to make fork-safe), and a restart
after a crash runs the plain command.

SIGWINCH because its default action is to ignore: one sent before this process has
blocked it is lost, not fatal, and the command file is checked every second anyway.
"""
from __future__ import annotations

import signal

WAKE = signal.SIGWINCH
signal.pthread_sigmask(signal.SIG_BLOCK, {WAKE})  # first: from here on a wake stays pending

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

WORKER_WARM = ("torch", "aiohttp", "prometheus_client", "kvyard.workers.server.cli",
               "kvyard.workers.server.serve", "kvyard.workers.engine.async_engine",
               "kvyard.workers.model.loader", "kvyard.workers.kvconnector",
               "kvyard.common.tokenizer")


def order_file(run_dir: Path, pid: int) -> Path:
    return run_dir / "spares" / f"{pid}.json"


def ready_file(run_dir: Path, pid: int) -> Path:
    """Exists once spare `pid` has done its imports (status and the bench read it)."""
    return run_dir / "spares" / f"{pid}.ready"


def command(run_dir: Path, warm: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "kvyard.stack.prestart", "--run-dir", str(run_dir),
            "--warm", ",".join(warm)]


def can_become(cmd: list[str]) -> bool:
    """A spare runs `python -m MODULE ...` commands of this interpreter."""
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m"


def wake(run_dir: Path, pid: int, cmd: list[str], log: str) -> None:
    """Tell spare `pid` to become `cmd`, logging to `log` (the order first, then the
    signal)."""
    path = order_file(run_dir, pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"cmd": cmd, "log": log}))
    tmp.replace(path)
    try:
        os.kill(pid, WAKE)
    except ProcessLookupError:
        pass  # gone: the supervisor sees the worker record die and restarts it plainly


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--warm", default=",".join(WORKER_WARM),
                   help="modules to import while waiting")
    a = p.parse_args()
    # What `kvyard.cli.main` sets before torch's first import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for name in filter(None, a.warm.split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an optional part (e.g. the connector) the command may not need
    run, pid = Path(a.run_dir), os.getpid()
    ready = ready_file(run, pid)
    ready.parent.mkdir(parents=True, exist_ok=True)
    ready.touch()
    order = order_file(run, pid)
    while not order.exists():
        signal.sigtimedwait({WAKE}, 1.0)
    spec = json.loads(order.read_text())
    order.unlink(missing_ok=True)
    ready.unlink(missing_ok=True)
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(WAKE, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {WAKE})
    cmd = spec["cmd"]
    sys.argv = [cmd[2], *cmd[3:]]
    runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
