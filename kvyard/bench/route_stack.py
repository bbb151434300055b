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
            cmd += ["--kv-events-config", json.dumps(cfg)]
        return cmd


@dataclass(slots=True)
class RouteStack:
    addresses: list[str]
    kv_events: dict[str, str]      # address -> its PUB endpoint (empty: the pods publish none)
    url: str                       # Envoy's listener
    epp: procs.Proc
    started: list[procs.Proc] = field(default_factory=list)
    epp_metrics: str = ""          # the EPP's metrics/debug base URL


def _port_run(n: int, taken: set[int], rng: random.Random) -> int:
    """The first of `n` consecutive free ports (the simulator offsets event ports per pod)."""
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        run = range(base, base + n)
        if not taken.intersection(run) and all(procs.port_free(p) for p in run):
            taken.update(run)
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


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
          epp_args: list[str] | None = None, observe_responses: bool = False) -> RouteStack:
    from kvyard.gateway.config import GatewayConfig
    from kvyard.gateway.envoy import envoy_command, write_config
    from kvyard.stack.commands import epp_cmd
    from kvyard.stack.readiness import epp_sees

    logs = run / "logs"
    taken: set[int] = set()
    rng = random.Random()
    ports = [procs.free_port(None, taken) for _ in range(pods.count)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    events = replay = None
    kv: dict[str, str] = {}
    rp: dict[str, str] = {}
    if pods.backend == "sim":
        events, replay = _port_run(pods.count, taken, rng), _port_run(pods.count, taken, rng)
        kv = {a: f"tcp://127.0.0.1:{events + i}" for i, a in enumerate(addresses)}
        rp = {a: f"tcp://127.0.0.1:{replay + i}" for i, a in enumerate(addresses)}
    started: list[procs.Proc] = []
    try:
        host = procs.spawn("pods", pods.command(ports, events, replay), logs / "pods.log")
        started.append(host)
        procs.wait_ready([(host, lambda: all(procs.http_ok(f"http://{a}/health")
                                             for a in addresses))], timeout_s)
        eports = tuple(procs.free_port(None, taken) for _ in range(3))
        extra = ["--scaler-port", str(procs.free_port(None, taken)), *(epp_args or [])]
        if epp_config is not None:
            extra = ["--config", str(epp_config), *extra]
        epp = procs.spawn("epp", epp_cmd("demo", eports, _endpoints_file(
            run / "endpoints.yaml", addresses, kv, rp), extra), logs / "epp.log")
        started.append(epp)
        gw, admin = procs.free_port(None, taken), procs.free_port(None, taken)
        conf = write_config(GatewayConfig(listen_port=gw, admin_port=admin,
                                          epp_address=f"127.0.0.1:{eports[0]}",
                                          body_limit_bytes=16 * 1024 * 1024,
                                          observe_responses=observe_responses),
                            run / "envoy.yaml")
        envoy = procs.spawn("envoy", envoy_command(conf, concurrency=2), logs / "envoy.log")
        started.append(envoy)
        procs.wait_ready([(epp, epp_sees(f"http://127.0.0.1:{eports[2]}", pods.count)),
                          (envoy, lambda: procs.http_ok(f"http://127.0.0.1:{admin}/ready"))],
                         timeout_s)
    except BaseException:
        procs.stop([p.pid for p in reversed(started)])
        raise
    return RouteStack(addresses, kv, f"http://127.0.0.1:{gw}", epp, started,
                      f"http://127.0.0.1:{eports[2]}")


def stop(stack: RouteStack) -> None:
    procs.stop([p.pid for p in reversed(stack.started)])
