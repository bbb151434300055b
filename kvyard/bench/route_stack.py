"""A pool for one `kvyard bench route` target: pods in one process, the EPP, Envoy.

The pods are `kvyard sim serve` (simulated pods with a prefix cache of a set size
that publish KV events on ZMQ) or stand-ins (`route_pods`, no model and no cache),
all of them in one process either way, so a 64-pod pool costs one interpreter.
The EPP is `kvyard epp` with the policy's scheduler config and an endpoints file
that names each pod's KV-event stream; Envoy fronts it as in `kvyard up`. A peer
router is started in front of the same pods by `route_peers`.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.stack import procs


@dataclass(slots=True)
class Pods:
    """The pool every target fronts: `backend` "sim" (`profile` its latency profile,
    `kv_blocks` each pod's KV cache in 16-token blocks) or "standin"."""

    backend: str = "sim"
    count: int = 8
    profile: str = "h100"
    kv_blocks: int | None = None
    max_model_len: int = 8192
    seed: int = 0
    time_scale: float = 1.0
    extra: list[str] = field(default_factory=list)  # more `sim serve` flags (LoRA's, say)

    def command(self, ports: list[int], events: int | None, replay: int | None) -> list[str]:
        from kvyard.stack.commands import py_module

        csv = ",".join(map(str, ports))
        if self.backend == "standin":
            return py_module("kvyard.bench.route_pods", "--ports", *map(str, ports))
        cmd = py_module("kvyard.cli", "sim", "serve", "--ports", csv, "--profile", self.profile,
                        "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
                        "--time-scale", str(self.time_scale), *self.extra)
        if self.kv_blocks:
            cmd += ["--kv-cache-size", str(self.kv_blocks)]
        if events is not None:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
            # newer vLLM's tagged-map events: the EPP reads either form, vllm-router's
            # kv_aware only this one
            cmd += ["--kv-events-config", json.dumps(cfg), "--kv-events-form", "map"]
        return cmd


@dataclass(slots=True)
class RouteStack:
    addresses: list[str]
    kv_events: dict[str, str]      # address -> its PUB endpoint (empty: the pods publish none)
    url: str                       # Envoy's listener
    epps: list[procs.Proc]         # one, or kvyard up's active-active replicas
    started: list[procs.Proc] = field(default_factory=list)
    epp_metrics: str = ""          # the EPP's metrics/debug base URL


def _endpoints_file(path: Path, addresses: list[str], kv: dict[str, str],
                    replay: dict[str, str]) -> Path:
    import yaml

    rows = []
    for a in addresses:
        row = {"address": a, "role": "both"}
        if a in kv:
            row.update(kv_events=kv[a], kv_events_replay=replay[a])
        rows.append(row)
    path.write_text(yaml.safe_dump(rows))
    return path


def start(pods: Pods, run: Path, epp_config: Path | None, timeout_s: float = 180.0,
          epp_replicas: int = 1, attempts: int = 3, epp_args: list[str] | None = None,
          observe_responses: bool = False) -> RouteStack:
    """Pods, then the EPP (`epp_replicas` > 1: that many sharing their picks, started
    and fronted as `kvyard up --epp-replicas N` does), then Envoy. A start that fails is
    tried again on fresh ports: on a shared machine another process can take one of the
    runs of free ports between the check and the pods' bind."""
    for attempt in range(1, attempts + 1):
        try:
            return _start(pods, run, epp_config, timeout_s, epp_replicas, epp_args or [], observe_responses)
        except Exception:  # noqa: BLE001 - everything started was stopped; the last is raised
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def _start(pods: Pods, run: Path, epp_config: Path | None, timeout_s: float,
           epp_replicas: int, more_epp_args: list[str], observe_responses: bool) -> RouteStack:
    from kvyard.gateway.config import GatewayConfig
    from kvyard.gateway.envoy import envoy_command, write_config
    from kvyard.stack.epp_replicas import epp_gateway, replicas_healthy, spawn_epps
    from kvyard.stack.kv_events import port_run
    from kvyard.stack.readiness import epp_sees
    from kvyard.stack.sim_pool import epp_args
    from kvyard.stack.spec import StackSpec

    logs = run / "logs"
    taken: set[int] = set()
    rng = random.Random()
    ports = [procs.free_port(None, taken) for _ in range(pods.count)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    events = replay = None
    kv: dict[str, str] = {}
    rp: dict[str, str] = {}
    if pods.backend == "sim":
        events, replay = port_run(pods.count, taken, rng), port_run(pods.count, taken, rng)
        kv = {a: f"tcp://127.0.0.1:{events + i}" for i, a in enumerate(addresses)}
        rp = {a: f"tcp://127.0.0.1:{replay + i}" for i, a in enumerate(addresses)}
    started: list[procs.Proc] = []
    try:
        host = procs.spawn("pods", pods.command(ports, events, replay), logs / "pods.log")
        started.append(host)
        procs.wait_ready([(host, lambda: all(procs.http_ok(f"http://{a}/health")
                                             for a in addresses))], timeout_s)
        # The scrape interval grows with the pool, as `kvyard up --sim N` sets it.
        extra = ["--scaler-port", str(procs.free_port(None, taken)), *epp_args(pods.count), *more_epp_args]
        if epp_config is not None:
            extra = ["--config", str(epp_config), *extra]
        spec = StackSpec(run_dir=run, model="demo", epp_replicas=epp_replicas,
                         epp_ports=(None, None, None))
        epps = spawn_epps(spec, _endpoints_file(run / "endpoints.yaml", addresses, kv, rp),
                          extra, taken, logs, lambda p: started.append(p) or p)
        gw, admin = procs.free_port(None, taken), procs.free_port(None, taken)
        cfg = GatewayConfig(listen_port=gw, admin_port=admin,
                            epp_address=f"127.0.0.1:{epps[0].ports['ext_proc']}",
                            body_limit_bytes=16 * 1024 * 1024, observe_responses=observe_responses)
        checks = [(e, epp_sees(f"http://127.0.0.1:{e.ports['metrics']}", pods.count))
                  for e in epps]
        envoy_ready = lambda: procs.http_ok(f"http://127.0.0.1:{admin}/ready")  # noqa: E731
        if len(epps) > 1:  # Envoy health-checks the replicas: start it once they are ready
            epp_gateway(cfg, epps)
            procs.wait_ready(checks, timeout_s)
            checks, envoy_ready = [], replicas_healthy(f"http://127.0.0.1:{admin}", len(epps))
        conf = write_config(cfg, run / "envoy.yaml")
        envoy = procs.spawn("envoy", envoy_command(conf, concurrency=2), logs / "envoy.log")
        started.append(envoy)
        procs.wait_ready([*checks, (envoy, envoy_ready)], timeout_s)
    except BaseException:
        procs.stop([p.pid for p in reversed(started)])
        raise
    return RouteStack(addresses, kv, f"http://127.0.0.1:{gw}", epps, started,
                      f"http://127.0.0.1:{epps[0].ports['metrics']}")


def stop(stack: RouteStack) -> None:
    procs.stop([p.pid for p in reversed(stack.started)])
