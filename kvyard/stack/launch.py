"""Starting a whole local stack: workers, the EPP, Envoy (and any extra service).

Used by `kvyard up`, the end-to-end tests and `kvyard bench epp`, so all
three run exactly the processes and flags a user runs. Services start in
dependency order (extras such as a redis for the kvstore, then workers, then
the EPP that scrapes them, then Envoy that calls the EPP); on any failure
everything already started is stopped and the error carries the log tail.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvyard.common import wire
from kvyard.gateway.config import GatewayConfig
from kvyard.gateway.envoy import envoy_command, write_config
from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES, conf_text, scratch_directives
from kvyard.stack import procs
from kvyard.stack.procs import Proc

STATE_FILE = "state.json"
# "ssd": a directory in the run dir, pool-wide because every local worker runs on
# this machine, and faster than Redis; "redis": a loopback redis-server, the
# authenticated pool-wide path Kubernetes takes across nodes; "none": DRAM only.
POOL_TIERS = ("ssd", "redis", "none")
REDIS_PASSWORD_ENV = "KVYARD_REDIS_PASSWORD"


@dataclass(slots=True)
class ServiceSpec:
    """A generic extra process (e.g. redis-server for the kvstore). `ready` is
    `http://...` (GET must return 200) or `tcp:PORT` (a connect must succeed)."""

    name: str
    cmd: list[str]
    ready: str
    ports: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StackSpec:
    run_dir: Path
    workers: int = 2
    # Preferred ports; a taken one (or None) means any free port.
    gateway_port: int | None = 8080
    model: str = "demo"
    dtype: str | None = None
    # Stand-in workers (no model): for tests and benchmarks of the routing path.
    standin: bool = False
    standin_args: list[str] = field(default_factory=list)
    worker_base_port: int | None = 8100
    epp_ports: tuple[int | None, int | None, int | None] = (
        wire.EPP_EXT_PROC_PORT, wire.EPP_HEALTH_PORT, wire.EPP_METRICS_PORT)
    admin_port: int | None = 9901
    scaler_port: int | None = wire.EPP_SCALER_PORT  # the EPP's KEDA scaler; taken: any free
    envoy_concurrency: int = 1
    body_limit_bytes: int = 4 * 1024 * 1024
    ready_timeout_s: float = 180.0
    extras: list[ServiceSpec] = field(default_factory=list)
    # The workers' kvstore: a DRAM tier each plus one pool tier that all of them
    # share (`POOL_TIERS`; docs/gateway-and-stack.md, "Store layout"). Never both
    # pool tiers: the one answering second would be written and never read.
    kv_tiers: bool = True
    kv_dram_gb: float = 1.0
    kv_pool_tier: str = "ssd"
    kv_ssd_gb: float = 4.0
    kv_redis_max_memory: int = DEFAULT_MAX_MEMORY_BYTES
    worker_args: list[str] = field(default_factory=list)
    epp_args: list[str] = field(default_factory=list)
    # P/D: prefill + decode workers instead of `workers` colocated ones (both 0: colocated).
    prefill: int = 0
    decode: int = 0
    # Scale to zero (colocated pools): an autoscaler (kvyard.stack.autoscale), a KEDA client
    # of the EPP's scaler, scales the workers between 0 and `workers`.
    scale_to_zero: bool = False
    idle_seconds: float = 300.0   # KEDA's cooldownPeriod
    polling_seconds: float = 5.0  # KEDA's pollingInterval (30 s there; the push wakes at once)
    scale_window_s: float = 30.0  # scale-down stabilization between 1 and `workers`
    pool_name: str = "local"      # the EPP's --pool-name, the autoscaler's scalerMetadata.pool
    prestart: bool = True         # keep a spare interpreter for the next worker (prestart.py)

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 or self.decode > 0

    def roles(self) -> list[str]:
        """One role per worker, in start order."""
        if self.disaggregated:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["both"] * self.workers


@dataclass(slots=True)
class StackState:
    """What `down` and `status` need, persisted as JSON in the run dir."""

    run_dir: str
    gateway_url: str
    admin_url: str
    epp_metrics_url: str
    endpoints: list[str]
    procs: list[Proc]
    spec: dict = field(default_factory=dict)
    # `kvyard up`'s supervisor (kvyard.stack.supervise), which restarts what dies
    supervisor: Proc | None = None
    # scale to zero: the scaled pool (kvyard.stack.resize.Pool.to_json), else None
    scaling: dict | None = None

    def save(self) -> None:
        data = {"run_dir": self.run_dir, "gateway_url": self.gateway_url,
                "admin_url": self.admin_url, "epp_metrics_url": self.epp_metrics_url,
                "endpoints": self.endpoints, "procs": [p.to_json() for p in self.procs],
                "spec": self.spec,
                "supervisor": self.supervisor.to_json() if self.supervisor else None,
                "scaling": self.scaling}
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)  # atomic: `down` never reads half a file

    @classmethod
    def load(cls, run_dir: Path) -> "StackState | None":
        try:
            d = json.loads((run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        sup = d.get("supervisor")
        return cls(run_dir=d["run_dir"], gateway_url=d["gateway_url"], admin_url=d["admin_url"],
                   epp_metrics_url=d["epp_metrics_url"], endpoints=d["endpoints"],
                   procs=[Proc(**p) for p in d["procs"]], spec=d.get("spec", {}),
                   supervisor=Proc(**sup) if sup else None, scaling=d.get("scaling"))

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def private_file(path: Path, text: str) -> Path:
    """Written 0600 from the start (never world-readable, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def redis_service(port: int, run: Path, max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES
                  ) -> tuple[ServiceSpec, Path]:
    """Loopback-only, nothing persisted, password required, capped with LRU eviction
    (`kvstore/redis_conf.py`): a scratch tier that dies with the stack. The password
    sits in 0600 files (the config, and `redis.password` that workers' environments
    are built from, at start and at every restart), never on a command line (`ps`)
    nor in the state file."""
    password = secrets.token_urlsafe(24)
    conf = private_file(run / "redis.conf",
                        conf_text(scratch_directives(port, password, max_memory_bytes)))
    secret = private_file(run / "redis.password", password)
    return ServiceSpec(name="redis", ready=f"tcp:{port}", ports={"redis": port},
                       cmd=["redis-server", str(conf)]), secret


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


def py_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def worker_cmd(spec: StackSpec, port: int | str, extra: list[str] | None = None,
               kv_args: list[str] | None = None, role: str = "both",
               pd_key: Path | None = None) -> list[str]:
    addr = f"127.0.0.1:{port}"
    role_args = ["--role", role] + (["--pd-key-file", str(pd_key)] if pd_key else [])
    if spec.standin:  # stand-ins take their own flags (e.g. --token-delay) and the kv ones
        return py_module("kvyard.stack.standin", "--port", str(port), "--advertise-address", addr,
                         *role_args, *spec.standin_args, *(kv_args or []))
    cmd = py_module("kvyard.cli", "worker", "--model", spec.model, "--host", "127.0.0.1",
                    "--port", str(port), "--advertise-address", addr, *role_args)
    if spec.dtype:
        cmd += ["--dtype", spec.dtype]
    return cmd + (kv_args or []) + (spec.worker_args if extra is None else extra)


def kv_layout(spec: StackSpec, run: Path, taken: set[int]
              ) -> tuple[list[str], dict[str, str], list[ServiceSpec]]:
    """The workers' kvstore flags, the files their secret environment comes from,
    and the services the layout needs (the redis-server of the "redis" pool tier)."""
    if spec.kv_pool_tier not in POOL_TIERS:
        raise ValueError(f"kv_pool_tier must be one of {POOL_TIERS}, not {spec.kv_pool_tier!r}")
    if not spec.kv_tiers:
        return [], {}, []
    args = ["--kv-dram-gb", str(spec.kv_dram_gb)]
    if spec.kv_pool_tier == "ssd":
        return args + ["--kv-ssd-dir", str(run / "kvcache"), "--kv-ssd-gb", str(spec.kv_ssd_gb)], \
            {}, []
    if spec.kv_pool_tier == "redis":
        rport = procs.free_port(6379, taken)
        service, secret = redis_service(rport, run, spec.kv_redis_max_memory)
        return args + ["--kv-redis-url", f"redis://127.0.0.1:{rport}"], \
            {REDIS_PASSWORD_ENV: str(secret)}, [service]
    return args, {}, []


def write_endpoints(path: Path, addresses: list[str], role: str | list[str] = "both") -> Path:
    """The EPP's endpoints file (`role`: one for all, or one per address); the EPP
    reloads it on change. Written atomically."""
    import yaml

    roles = [role] * len(addresses) if isinstance(role, str) else list(role)
    if len(roles) != len(addresses):
        raise ValueError(f"{len(addresses)} addresses but {len(roles)} roles")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump([{"address": a, "role": r} for a, r in zip(addresses, roles)]))
    tmp.replace(path)
    return path


def epp_cmd(model: str, ports: tuple[int, int, int], endpoints_file: Path,
            extra: list[str] | None = None) -> list[str]:
    ext, health, metrics = ports
    # Two fallbacks after each pick: the gateway retries a request on them when the pick
    # refuses the connection or resets it before answering (a worker that just died).
    return py_module("kvyard.cli", "epp", "--host", "127.0.0.1", "--ext-proc-port", str(ext),
                     "--health-port",
                     str(health), "--metrics-port", str(metrics), "--endpoints-file",
                     str(endpoints_file), "--model", model, "--destination-fallbacks", "2",
                     *(extra or []))


def pd_scheduler_config() -> Path:
    """kvyard's P/D scheduler config (decode first), shipped with the EPP package."""
    import importlib.util

    return Path(importlib.util.find_spec("kvyard.epp").origin).parent / "scheduler.pd.example.yaml"


def pd_key_file(run: Path) -> Path:
    """A fresh 0600 key that the EPP signs prefill targets with and workers verify."""
    return private_file(run / "pd.key", secrets.token_hex(32) + "\n")


def tcp_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _ready_check(ready: str) -> Callable[[], bool]:
    if ready.startswith("tcp:"):
        port = int(ready[4:])
        return lambda: tcp_ok(port)
    return lambda: procs.http_ok(ready)


def epp_sees(metrics_url: str, n: int) -> Callable[[], bool]:
    """Ready once the EPP's /debug/endpoints lists at least `n` freshly scraped
    endpoints and its tokenizer has loaded: before that it hashes prompts as
    bytes, so a prefix routed then would not match the same prefix routed later."""
    def check() -> bool:
        code, body = procs.http_get(metrics_url + "/debug/endpoints")
        doc = json.loads(body) if code == 200 else {}
        if isinstance(doc, dict) and doc.get("tokenizer") == "loading":
            return False
        rows = parse_endpoints(doc)
        return sum(1 for r in rows if r.get("fresh", True)) >= n
    return check


def parse_endpoints(doc: object) -> list[dict]:
    """The EPP's /debug/endpoints rows, whether it answers a list or {"endpoints": [...]}."""
    rows = doc.get("endpoints", []) if isinstance(doc, dict) else doc
    return [r for r in rows or [] if isinstance(r, dict)]


class _Started(list):
    """Started processes, recorded in the state file as each one starts, so
    `kvyard down` can stop them even if `up` itself is killed mid-way."""

    def __init__(self, run: Path) -> None:
        super().__init__()
        self.run = run

    def add(self, p: Proc) -> Proc:
        self.append(p)
        StackState(run_dir=str(self.run), gateway_url="", admin_url="", epp_metrics_url="",
                   endpoints=[], procs=list(self), spec={"starting": True}).save()
        return p


def start_stack(spec: StackSpec) -> StackState:
    """Start everything, wait until all of it is ready, save the state file."""
    run = spec.run_dir
    run.mkdir(parents=True, exist_ok=True)
    logs = run / "logs"
    taken: set[int] = set()
    started = _Started(run)
    try:
        checks: list[tuple[Proc, Callable[[], bool]]] = []
        kv_args, kv_env_files, kv_services = kv_layout(spec, run, taken)
        for ex in [*spec.extras, *kv_services]:
            p = procs.spawn(ex.name, ex.cmd, logs / f"{ex.name}.log", ports=ex.ports)
            started.add(p)
            checks.append((p, _ready_check(ex.ready)))
        addresses = []
        roles = spec.roles()
        pd_key = pd_key_file(run) if spec.disaggregated else None
        for i, role in enumerate(roles):
            base = spec.worker_base_port
            port = procs.free_port(None if base is None else base + i, taken)
            addresses.append(f"127.0.0.1:{port}")
            cmd = worker_cmd(spec, port, kv_args=kv_args, role=role, pd_key=pd_key)
            p = procs.spawn(f"worker-{i}", cmd,
                            logs / f"worker-{i}.log", env_files=kv_env_files,
                            ports={"http": port})
            started.add(p)
            checks.append((p, _ready_check(f"http://127.0.0.1:{port}/health")))
        # Workers load models in parallel; wait for them before the EPP scrapes.
        procs.wait_ready(checks, spec.ready_timeout_s)
        epp_ports = tuple(procs.free_port(p, taken) for p in spec.epp_ports)
        endpoints_file = write_endpoints(run / "endpoints.yaml", addresses, roles)
        scaler_port = procs.free_port(spec.scaler_port, taken)
        epp_args = ["--scaler-port", str(scaler_port), "--pool-name", spec.pool_name,
                    *spec.epp_args]
        if pd_key is not None:
            epp_args = ["--config", str(pd_scheduler_config()), "--pd-key-file", str(pd_key),
                        *epp_args]
        epp = procs.spawn("epp", epp_cmd(spec.model, epp_ports, endpoints_file, epp_args),
                          logs / "epp.log", ports={**dict(zip(("ext_proc", "health", "metrics"),
                                                              epp_ports)),
                                                   "scaler": scaler_port})
        started.add(epp)
        metrics_url = f"http://127.0.0.1:{epp_ports[2]}"
        gw_port = procs.free_port(spec.gateway_port, taken)
        admin_port = procs.free_port(spec.admin_port, taken)
        cfg = GatewayConfig(listen_port=gw_port, epp_address=f"127.0.0.1:{epp_ports[0]}",
                            admin_port=admin_port, body_limit_bytes=spec.body_limit_bytes)
        conf = write_config(cfg, run / "envoy.yaml")
        envoy = procs.spawn("envoy", envoy_command(conf, concurrency=spec.envoy_concurrency),
                            logs / "envoy.log", ports={"http": gw_port, "admin": admin_port})
        started.add(envoy)
        admin_url = f"http://127.0.0.1:{admin_port}"
        procs.wait_ready([(epp, epp_sees(metrics_url, len(roles))),
                          (envoy, _ready_check(admin_url + "/ready"))], spec.ready_timeout_s)
        scaling = _start_autoscaler(spec, run, started, scaler_port, kv_args, kv_env_files,
                                    len(roles)) if spec.scale_to_zero else None
    except BaseException:
        procs.stop([p.pid for p in reversed(started)])
        (run / STATE_FILE).unlink(missing_ok=True)
        raise
    state = StackState(run_dir=str(run), gateway_url=f"http://127.0.0.1:{gw_port}",
                       admin_url=admin_url, epp_metrics_url=metrics_url, endpoints=addresses,
                       procs=list(started), spec={"workers": len(roles), "model": spec.model,
                                            "prefill": spec.prefill, "decode": spec.decode,
                                            "dtype": spec.dtype, "standin": spec.standin,
                                            "kv_pool_tier": spec.kv_pool_tier if spec.kv_tiers
                                            else None, "started": time.time(),
                                            "scale_to_zero": spec.scale_to_zero},
                       scaling=scaling)
    state.save()
    return state


def _start_autoscaler(spec: StackSpec, run: Path, started: "_Started", scaler_port: int,
                      kv_args: list[str], kv_env_files: dict[str, str], n: int) -> dict:
    """The scaled pool's record (its worker command with `{port}` to fill in) and the
    autoscaler process, KEDA's part, started once the EPP's scaler serves."""
    from kvyard.stack import autoscale, prestart, resize

    if spec.disaggregated:
        raise ValueError("scale to zero runs colocated pools (--workers), not P/D")
    pool = resize.Pool(role="both", template=worker_cmd(spec, resize.PORT, kv_args=kv_args),
                       env_files=kv_env_files, min_replicas=0, max_replicas=n, next_index=n,
                       pool=spec.pool_name, warm=None if not spec.prestart else
                       ["aiohttp"] if spec.standin else list(prestart.WORKER_WARM))
    target = autoscale.Target(spec.pool_name, "both", 0, n, spec.idle_seconds,
                              spec.polling_seconds, spec.scale_window_s)
    (run / autoscale.FILE).unlink(missing_ok=True)  # a previous stack's wishes are not ours
    cmd = autoscale.command(run, f"127.0.0.1:{scaler_port}", target, n)
    started.add(procs.spawn("autoscaler", cmd, run / "logs" / "autoscaler.log",
                            ports={"scaler": scaler_port}))
    return pool.to_json()


def stack_alive(state: StackState) -> bool:
    """All recorded processes (and the supervisor, when there is one) run and the
    gateway answers its admin readiness."""
    sup = [state.supervisor] if state.supervisor else []
    return all(procs.is_ours(p) for p in [*state.procs, *sup]) \
        and procs.http_ok(state.admin_url + "/ready")


def stop_stack(state: StackState, timeout_s: float = 5.0) -> None:
    """The supervisor first, so it restarts nothing that is being stopped; then the
    state file again (it may have restarted something just before), front to back
    (Envoy first) so no new traffic reaches dying workers. Only pids that still run
    what we started are signalled."""
    run = Path(state.run_dir)
    if state.supervisor is not None and procs.is_ours(state.supervisor):
        procs.stop([state.supervisor.pid], timeout_s)
        state = StackState.load(run) or state
    procs.stop([p.pid for p in reversed(state.procs) if procs.is_ours(p)], timeout_s)
    (run / STATE_FILE).unlink(missing_ok=True)
