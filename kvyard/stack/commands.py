"""The command lines and files a local stack's processes start with: workers (real or
stand-in), the EPP, the redis-server of the "redis" pool tier, and the P/D key."""
from __future__ import annotations

import os
import secrets
import shutil
import sys
from pathlib import Path

from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES, conf_text, scratch_directives
from kvyard.stack import procs
from kvyard.stack.spec import POOL_TIERS, REDIS_PASSWORD_ENV, ServiceSpec, StackSpec


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
    if spec.sim:  # a simulated pod in a process of its own (scale to zero's workers)
        from kvyard.stack.sim_pool import pod_cmd

        return pod_cmd(spec, port, role, pd_key)
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
