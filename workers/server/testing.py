"""A real `kvyard worker` in a child process, for integration tests of any component.

Tests talk to it over HTTP exactly as the gateway would, so what they check is
the shipped command, flags and shutdown path, not an in-process shortcut.
Readiness is polled with a deadline; the log goes to a file so a chatty
worker can never block on a full pipe.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class WorkerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the exit code tells whether shutdown was graceful."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise


def start_worker(args: list[str], log_path: Path, *, timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> WorkerProcess:
    """Starts `kvyard worker <args>` on a free loopback port and waits for /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvyard.cli", "worker", "--host", "127.0.0.1",
           "--port", str(port), *args]
    full_env = dict(os.environ if env is None else env)
    log = open(log_path, "wb")
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    finally:
        log.close()
    worker = WorkerProcess(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{worker.log_tail()}")
        try:
            with urllib.request.urlopen(worker.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return worker
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # a poll interval under a deadline, not a synchronisation sleep
    worker.proc.kill()
    worker.proc.wait(10)
    raise TimeoutError(f"worker not ready after {timeout}s:\n{worker.log_tail()}")
