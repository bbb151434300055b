"""Start and stop a private redis-server, or a real Redis Cluster of them: used by
the tests and `kvyard bench kvstore`.

Binds loopback only, requires a password, persists nothing, is capped with LRU
eviction (`redis_conf.py`), and is reaped by `stop()`. Readiness is polled with
a deadline, never slept for.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import redis

from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES, cli_args, scratch_directives


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all n sockets are held until every port is known. Picked one
    at a time and released, the kernel may hand the same port out twice, and a cluster
    needs six (a port and a bus port per master)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RedisServer:
    """One redis-server, bounded like every Redis kvyard starts (`redis_conf.py`):
    `max_memory_bytes` with allkeys-lru, 1 GiB unless given."""

    def __init__(self, port: int | None = None, password: str = "kvyard-test",
                 max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.password = password
        self.max_memory_bytes = max_memory_bytes
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        """The URL without the password (pass it separately, as a deployment would)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self._dir = tempfile.mkdtemp(prefix="kvyard-redis-")
        args = [exe, *cli_args(scratch_directives(self.port, self.password,
                                                  self.max_memory_bytes)),
                "--dir", self._dir, *self.extra_args]
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

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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


class RedisClusterServers:
    """A real Redis Cluster of `masters` redis-servers (no replicas) on loopback, each
    with its own port, bus port, temp dir and nodes.conf, `requirepass` and
    `masterauth`; formed with `redis-cli --cluster create` and polled until every
    node reports `cluster_state:ok` with all slots assigned and every peer known.

    `full_coverage=False` (`cluster-require-full-coverage no`) keeps the surviving
    masters serving their slots when one dies, which is what a cache wants; with
    Redis's default (yes) the whole cluster answers CLUSTERDOWN until the dead
    master is back or replaced.
    """

    def __init__(self, masters: int = 3, password: str = "kvyard-test",
                 node_timeout_ms: int = 500, full_coverage: bool = False) -> None:
        self.password = password
        ports = free_ports(2 * masters)  # each node's port and cluster-bus port, all distinct
        self.nodes = [RedisServer(port=ports[2 * i], password=password, extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(ports[2 * i + 1]), "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-require-full-coverage", "yes" if full_coverage else "no",
            "--masterauth", password)) for i in range(masters)]

    @property
    def url(self) -> str:
        """`redis+cluster://` URL of the first node (the others are discovered), no password."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def client(self, i: int) -> redis.Redis:
        """A plain (non-cluster) client of node i, for inspecting or tampering with it."""
        return redis.Redis(host="127.0.0.1", port=self.nodes[i].port, password=self.password,
                           socket_timeout=2.0, socket_connect_timeout=2.0)

    def start(self, timeout: float = 30.0) -> "RedisClusterServers":
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.start(timeout)
            cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
            done = subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                env=dict(os.environ, REDISCLI_AUTH=self.password), capture_output=True,
                text=True, timeout=max(1.0, deadline - time.monotonic()))
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}"
                                   f"{done.stderr[-2000:]}")
            self.wait_state(lambda info: info.get("cluster_state") == "ok"
                            and info.get("cluster_slots_assigned") == "16384"
                            and info.get("cluster_known_nodes") == str(len(self.nodes)),
                            deadline, "cluster_state:ok on every node")
        except BaseException:
            self.stop()
            raise
        return self

    def cluster_info(self, i: int) -> dict[str, str]:
        c = self.client(i)
        try:
            info = c.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
            return {str(k): str(v) for k, v in info.items()}
        finally:
            c.close()

    def wait_state(self, ok, deadline: float, what: str, nodes: list[int] | None = None) -> None:
        """Poll CLUSTER INFO of `nodes` (default: the running ones) until `ok(info)` holds
        on each, or raise TimeoutError at `deadline` (a time.monotonic() value)."""
        idx = nodes if nodes is not None else [i for i, n in enumerate(self.nodes) if n.running]
        while True:
            try:
                if all(ok(self.cluster_info(i)) for i in idx):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster: no {what} before the deadline")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """Kill master i (SIGKILL, as a crash): its slots stay assigned to it."""
        self.nodes[i].stop()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisClusterServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
