"""Starting a whole local stack: workers, the EPP, Envoy (and any extra service).

Used by `kvyard up`, the end-to-end tests and the benches of whole stacks
(`bench pd`, `bench hardening`), so all of them run exactly the processes and
flags a user runs (`commands`; what to run is a `spec.StackSpec`). Services start in
dependency order (extras such as a redis for the kvstore, then workers, then
the EPP that scrapes them, then Envoy that calls the EPP); on any failure
everything already started is stopped and the error carries the log tail.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from kvyard.gateway.config import GatewayConfig
from kvyard.gateway.envoy import envoy_command, write_config
from kvyard.stack import procs
from kvyard.stack.commands import kv_layout, pd_key_file, pd_scheduler_config, worker_cmd
from kvyard.stack.endpoints_file import write_endpoints
from kvyard.stack.epp_replicas import epp_gateway, replicas_healthy, spawn_epps
from kvyard.stack.kv_events import EventPorts, wanted
from kvyard.stack.procs import Proc
from kvyard.stack.readiness import epp_sees, ready_check
from kvyard.stack.spec import StackSpec
from kvyard.stack.state import STATE_FILE, StackState


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
            checks.append((p, ready_check(ex.ready)))
        addresses = []
        roles = spec.roles()
        pd_key = pd_key_file(run) if spec.disaggregated else None
        sim_pods = bool(spec.sim) and not spec.scale_to_zero  # many pods per process
        pools: list[str] | None = None
        # KV events for one pool's workers; several models' pools wire their own
        events = EventPorts.allocate(len(roles), taken) if wanted(spec) and not spec.named_models else None
        streams = None
        if spec.named_models:  # a pool per model, each with its KV events (stack/models.py)
            from kvyard.stack.models import spawn_model_pools

            addresses, roles, pools, more, streams = spawn_model_pools(
                spec, roles, taken, logs, kv_args, kv_env_files, pd_key, started.add)
            checks += more
        elif sim_pods:
            from kvyard.stack.sim_pool import spawn_sim_pods

            addresses, sim_checks = spawn_sim_pods(spec, roles, taken, logs, pd_key, started.add,
                                                   extra=events.flag() if events else [])
            checks += sim_checks
        for i, role in enumerate([] if sim_pods or pools is not None else roles):
            base = spec.worker_base_port
            port = procs.free_port(None if base is None else base + i, taken)
            addresses.append(f"127.0.0.1:{port}")
            cmd = worker_cmd(spec, port, kv_args=kv_args, role=role, pd_key=pd_key)
            cmd += events.flag(i) if events else []
            p = procs.spawn(f"worker-{i}", cmd,
                            logs / f"worker-{i}.log", env_files=kv_env_files,
                            ports={"http": port})
            started.add(p)
            checks.append((p, ready_check(f"http://127.0.0.1:{port}/health")))
        # Workers load models in parallel; wait for them before the EPP scrapes.
        procs.wait_ready(checks, spec.ready_timeout_s)
        endpoints_file = write_endpoints(run / "endpoints.yaml", addresses, roles, pools,
                                         events.streams(addresses) if events else streams)
        scaler_port = procs.free_port(spec.scaler_port, taken)
        epp_args = ["--scaler-port", str(scaler_port), "--pool-name", spec.pool_name,
                    *spec.epp_args]
        if spec.named_models or spec.adapters:
            from kvyard.stack.models import models_file

            epp_args += ["--models-file", str(models_file(run / "models.json", spec))]
        if pd_key is not None:
            epp_args = ["--config", str(pd_scheduler_config()), "--pd-key-file", str(pd_key),
                        *epp_args]
        epps = spawn_epps(spec, endpoints_file, epp_args, taken, logs, started.add)
        metrics_url = f"http://127.0.0.1:{epps[0].ports['metrics']}"
        gw_port = procs.free_port(spec.gateway_port, taken)
        admin_port = procs.free_port(spec.admin_port, taken)
        cfg = GatewayConfig(listen_port=gw_port,
                            epp_address=f"127.0.0.1:{epps[0].ports['ext_proc']}",
                            admin_port=admin_port, body_limit_bytes=spec.body_limit_bytes)
        admin_url = f"http://127.0.0.1:{admin_port}"
        epp_checks = [(e, epp_sees(f"http://127.0.0.1:{e.ports['metrics']}", len(roles)))
                      for e in epps]
        envoy_ready = ready_check(admin_url + "/ready")
        if len(epps) > 1:  # Envoy health-checks the replicas: start it once they are ready
            epp_gateway(cfg, epps)
            procs.wait_ready(epp_checks, spec.ready_timeout_s)
            epp_checks, envoy_ready = [], replicas_healthy(admin_url, len(epps))
        conf = write_config(cfg, run / "envoy.yaml")
        envoy = procs.spawn("envoy", envoy_command(conf, concurrency=spec.envoy_concurrency),
                            logs / "envoy.log", ports={"http": gw_port, "admin": admin_port})
        started.add(envoy)
        procs.wait_ready([*epp_checks, (envoy, envoy_ready)], spec.ready_timeout_s)
        scaling = None
        if spec.scale_to_zero:
            from kvyard.stack.scaling import start_autoscaler  # its imports only when scaling

            scaling = start_autoscaler(spec, run, started.add, scaler_port, kv_args,
                                       kv_env_files, len(roles))
    except BaseException:
        procs.stop([p.pid for p in reversed(started)])
        (run / STATE_FILE).unlink(missing_ok=True)
        raise
    state = StackState(run_dir=str(run), gateway_url=f"http://127.0.0.1:{gw_port}",
                       admin_url=admin_url, epp_metrics_url=metrics_url, endpoints=addresses,
                       procs=list(started), spec={"workers": len(roles), "model": spec.model,
                                            "models": [n for n, _ in spec.named_models],
                                            "prefill": spec.prefill, "decode": spec.decode,
                                            "dtype": spec.dtype, "standin": spec.standin,
                                            "sim": spec.sim, "sim_profile": spec.sim_profile,
                                            "sim_kv_cache_size": spec.sim_kv_cache_size,
                                            "kv_pool_tier": spec.kv_pool_tier if spec.kv_tiers
                                            else None, "started": time.time(),
                                            "scale_to_zero": spec.scale_to_zero,
                                            "epp_replicas": spec.epp_replicas},
                       scaling=scaling)
    state.save()
    return state


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
