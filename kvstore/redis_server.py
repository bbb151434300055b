"""Start and stop a private redis-server: used by the tests and `kvyard bench kvstore`.

Binds loopback only, requires a password, persists nothing, and is reaped by
`stop()`. Readiness is polled with a deadline, never slept for.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, password: str = "kvyard-test",
                 maxmemory: str | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        """The URL without the password (pass it separately, as a deployment would)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self._dir = tempfile.mkdtemp(prefix="kvyard-redis-")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass",
                self.password, "--save", "", "--appendonly", "no", "--dir", self._dir,
                "--protected-mode", "yes"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server on port {self.port} not ready")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
