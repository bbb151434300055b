"""What a local stack is made of: its workers, ports, store layout and extra services.

`kvyard up`'s flags, the tests and the benches fill in a `StackSpec`; `launch`
starts what it describes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvyard.common import wire
from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES

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
    # `--model NAME=SOURCE` repeated (stack/models.py): a pool per model; []: one pool of `model`
    named_models: list[tuple[str, str]] = field(default_factory=list)
    # `--adapter [MODEL:]NAME=PATH`: (model, name, path), model "" for the unnamed one
    adapters: list[tuple[str, str, str]] = field(default_factory=list)
    max_loras: int = 4
    dtype: str | None = None
    # Stand-in workers (no model): for tests and benchmarks of the routing path.
    standin: bool = False
    standin_args: list[str] = field(default_factory=list)
    # Simulated pods (kvyard.sim, `kvyard up --sim N`): `workers`/`prefill`/`decode` of them,
    # many per process (kvyard.stack.sim_pool). 0: real workers.
    sim: int = 0
    sim_profile: str = "cpu-demo"
    sim_kv_cache_size: int = 4096
    sim_args: list[str] = field(default_factory=list)
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
    # Each worker publishes its KV events and the EPP subscribes (kvyard.stack.kv_events).
    kv_events: bool = True
    epp_args: list[str] = field(default_factory=list)
    # Active-active EPPs behind the one Envoy, sharing their picks (kvyard.epp.replicas).
    epp_replicas: int = 1
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
    scale_min: int = 0            # the autoscaler's bounds: min, and max (None: `workers`)
    scale_max: int | None = None
    scaler_metadata: dict[str, str] = field(default_factory=dict)  # e.g. targetValue, signal
    scale_up_args: list[str] = field(default_factory=list)  # flags of the workers it adds

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 or self.decode > 0

    def roles(self) -> list[str]:
        """One role per worker, in start order."""
        if self.disaggregated:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["both"] * self.workers
