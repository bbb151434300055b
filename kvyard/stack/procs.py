"""Background processes that outlive the command that started them.

`kvyard up` returns while its workers, EPP and Envoy keep running, and
`kvyard down` must stop them even after `up` or a child crashed. So every
child gets its own session (its pid is its process-group id) and we always
signal the whole group: a worker's own children die with it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable


@dataclass(slots=True)
class Proc:
    """One started process as recorded in the state file: enough to start it again
    the same way. `env_files` maps environment variables to the (0600) files their
    values are read from, so secrets stay out of the state file and command lines.
    `restarts` and `last_exit` are the supervisor's record."""

    name: str
    pid: int
    log: str
    cmd: list[str]
    ports: dict[str, int] = field(default_factory=dict)
    env_files: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    last_exit: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def file_env(env_files: dict[str, str]) -> dict[str, str]:
    """The variables `env_files` names, each the content of its file."""
    return {k: Path(f).read_text().strip() for k, f in env_files.items()}


def spawn(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None,
          ports: dict[str, int] | None = None,
          env_files: dict[str, str] | None = None) -> Proc:
    """Start `cmd` detached (new session), stdout+stderr appended to `log`.
    `env` is not recorded (a restart would not have it); `env_files` is."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full = {**os.environ, **(env or {}), **file_env(env_files or {})}
    with open(log, "ab") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=full, close_fds=True)
    return Proc(name=name, pid=p.pid, log=str(log), cmd=cmd, ports=dict(ports or {}),
                env_files=dict(env_files or {}))


def alive(pid: int) -> bool:
    """True while `pid` runs. Reaps it first if it is our own exited child,
    so a zombie never counts as alive."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to a signal-0 probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # An exited process whose parent (often init) has not reaped it yet is a zombie.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def is_ours(proc: Proc) -> bool:
    """The pid still runs the command we started. After a reboot or a long time
    a recorded pid may belong to someone else; never signal that."""
    try:
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return False
    args = [a.decode(errors="replace") for a in argv]
    if args == proc.cmd:
        return True
    # Some servers (redis-server) rewrite their title; then the program name must match.
    first = args[0].split()[0] if args and args[0].split() else ""
    return Path(first).name == Path(proc.cmd[0]).name


def cpu_seconds(pid: int) -> float:
    """User+system CPU time a process has used so far (all its threads), from /proc.
    Lets benchmarks report CPU per request, which a busy shared machine skews
    far less than wall-clock throughput."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(pids: Iterable[int], timeout_s: float = 5.0) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left at the deadline.
    Missing pids are fine: a crashed child is already stopped."""
    pids = [p for p in pids if p > 0]
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.02)
    for pid in pids:
        if alive(pid):
            _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.02)


def port_free(port: int) -> bool:
    """Bindable as our servers bind (SO_REUSEADDR), so a port left in TIME_WAIT
    by the previous stack still counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None, taken: set[int] | None = None) -> int:
    """`preferred` if it is free and not already handed out, else any free port."""
    taken = taken if taken is not None else set()
    if preferred and preferred not in taken and port_free(preferred):
        taken.add(preferred)
        return preferred
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


def http_get(url: str, timeout_s: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback only
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        return http_get(url, timeout_s)[0] == 200
    except OSError:
        return False


def tcp_ok(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    """Something accepts connections on `host:port` (a readiness check or probe)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def log_tail(path: str | Path, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class StartupError(RuntimeError):
    """A process died or never became ready; the message carries its log tail."""


def wait_ready(procs: list[tuple[Proc, Callable[[], bool]]], timeout_s: float) -> None:
    """Poll each process's readiness check until all pass; fail fast if one exits."""
    pending = list(procs)
    deadline = time.monotonic() + timeout_s
    while pending:
        for item in list(pending):
            proc, ready = item
            if not alive(proc.pid):
                raise StartupError(f"{proc.name} exited during startup; log {proc.log}:\n"
                                   + log_tail(proc.log))
            try:
                ok = ready()
            except Exception:  # noqa: BLE001 - not ready yet
                ok = False
            if ok:
                pending.remove(item)
        if not pending:
            return
        if time.monotonic() > deadline:
            proc = pending[0][0]
            raise StartupError(f"{proc.name} not ready after {timeout_s:g}s; log {proc.log}:\n"
                               + log_tail(proc.log))
        time.sleep(0.05)
