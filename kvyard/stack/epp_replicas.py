"""`kvyard up --epp-replicas N`: N EPP processes that share their picks, and the
gateway's ext_proc cluster over all of them (kvyard.epp.replicas says why)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvyard.gateway.config import EPP_CLUSTER, GatewayConfig
from kvyard.stack import procs
from kvyard.stack.commands import epp_cmd
from kvyard.stack.procs import Proc
from kvyard.stack.spec import StackSpec

# A local replica waits this long for a peer's recent picks before it serves alone:
# they all start together, so the first answer comes at once or not at all.
CATCH_UP_S = 2.0


def _pair(taken: set[int]) -> int:
    """A free port whose next one is free too (the pick PUB and its snapshot ROUTER)."""
    while True:
        p = procs.free_port(None, taken)
        if procs.free_port(p + 1, taken) == p + 1:
            return p


def spawn_epps(spec: StackSpec, endpoints_file: Path, epp_args: list[str], taken: set[int],
               logs: Path, add: Callable[[Proc], Proc]) -> list[Proc]:
    """The first EPP is `epp` (with the KEDA scaler); more are `epp-1`, `epp-2`, ...
    Each is recorded (`add`) as it starts, so a failure part-way stops those started."""
    n = max(1, spec.epp_replicas)
    ports = [tuple(procs.free_port(p if i == 0 else None, taken) for p in spec.epp_ports)
             for i in range(n)]
    pubs = [_pair(taken) for _ in range(n)] if n > 1 else []
    peers = ",".join(f"127.0.0.1:{p}" for p in pubs)
    scaler = epp_args[epp_args.index("--scaler-port") + 1]
    out = []
    for i in range(n):
        args = list(epp_args)
        names = dict(zip(("ext_proc", "health", "metrics"), ports[i]))
        if n > 1:
            args += ["--replica-port", str(pubs[i]), "--peers", peers,
                     "--catch-up-timeout", str(CATCH_UP_S)]
            names["replica"] = pubs[i]
        if i == 0:
            names["scaler"] = int(scaler)
        else:  # one KEDA scaler per pool: the autoscaler asks the first EPP
            args[args.index("--scaler-port") + 1] = "-1"
        name = "epp" if i == 0 else f"epp-{i}"
        out.append(add(procs.spawn(name, epp_cmd(spec.model, ports[i], endpoints_file, args),
                                   logs / f"{name}.log", ports=names)))
    return out


def epp_gateway(cfg: GatewayConfig, epps: list[Proc]) -> None:
    """Envoy's EPP cluster over every replica: health-checked, streams retried elsewhere."""
    cfg.epp_addresses = [f"127.0.0.1:{e.ports['ext_proc']}" for e in epps]
    cfg.epp_health_ports = [e.ports["health"] for e in epps]
    cfg.epp_stream_retries = len(epps) - 1


def epps_view(state) -> list[dict]:
    """`kvyard status`: each EPP process, whether it runs, and its pick-sharing counters."""
    import json

    out = []
    for p in state.procs:
        if p.name != "epp" and not p.name.startswith("epp-"):
            continue
        url = f"http://127.0.0.1:{p.ports.get('metrics')}"
        replicas = None
        try:
            code, body = procs.http_get(url + "/debug/endpoints", 1.0)
            if code == 200:
                doc = json.loads(body)
                replicas = doc.get("replicas") if isinstance(doc, dict) else None
            answers = code == 200
        except (OSError, ValueError):
            answers = False
        out.append({"name": p.name, "pid": p.pid, "running": procs.is_ours(p),
                    "answers": answers, "ext_proc": p.ports.get("ext_proc"),
                    "metrics": url, "replicas": replicas})
    return out


def fmt_epps(epps: list[dict]) -> str:
    return "epp: " + "; ".join(
        f"{e['name']} (pid {e['pid']}, ext_proc :{e['ext_proc']}, "
        f"{'up' if e['answers'] else 'down'}"
        + (f", picks sent {e['replicas']['sent']} received {e['replicas']['received']}"
           if e["replicas"] else "") + ")" for e in epps)


def replicas_healthy(admin_url: str, n: int) -> Callable[[], bool]:
    """Envoy is ready and its health checks passed on all `n` EPP replicas."""
    def check() -> bool:
        if not procs.http_ok(admin_url + "/ready"):
            return False
        try:
            code, body = procs.http_get(admin_url + "/clusters", 1.0)
        except OSError:
            return False
        flags = [line for line in body.decode().splitlines()
                 if line.startswith(EPP_CLUSTER + "::") and "::health_flags::" in line]
        return code == 200 and len(flags) == n and all(f.endswith("::healthy") for f in flags)
    return check
