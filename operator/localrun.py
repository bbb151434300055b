"""Run what the operator rendered as local processes on loopback (tests, no cluster).

Each Deployment's container runs with its own command, args and env, rewritten only
where a pod and a laptop differ: every port a pod declares (and Envoy's loopback
admin port) gets a free local port, bind addresses 0.0.0.0 become 127.0.0.1,
ConfigMap and Secret volumes are written as files under a temp dir at their mount
paths (emptyDirs become dirs there), and a Service name (`<svc>.<ns>.svc`) becomes
127.0.0.1 with the local port of the pod port its targetPort names. There is no
API server, so the EPP's Kubernetes discovery (`--k8s-*`) is replaced by an
endpoints file listing the worker pods with their role and pool labels, and `fieldRef`s are
filled in (podIP 127.0.0.1). Readiness is each container's own rendered probe.
A flag the program does not take, an Envoy config it refuses, or a port that does
not line up between a flag, a containerPort, a Service and a probe fails the run.
"""
from __future__ import annotations

import base64
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvyard.common import wire
from kvyard.gateway.envoy import envoy_binary
from kvyard.stack import procs

_K8S_FLAGS = {"--k8s-namespace", "--k8s-selector", "--target-port"}


class RenderedRunError(RuntimeError):
    """The rendered objects cannot run as they are."""


@dataclass(slots=True)
class Pod:
    name: str
    labels: dict[str, str]
    container: dict[str, Any]
    volumes: dict[str, dict[str, Any]]
    root: Path
    ports: dict[int, int] = field(default_factory=dict)   # pod port -> local port
    proc: procs.Proc | None = None

    def port(self, ref: int | str) -> int:
        """A probe's or Service's port (number or containerPort name) -> local port."""
        for p in self.container.get("ports", []):
            if ref in (p["name"], p["containerPort"]):
                return self.ports[p["containerPort"]]
        if isinstance(ref, int) and ref in self.ports:
            return self.ports[ref]
        raise RenderedRunError(f"{self.name}: no port {ref!r} among "
                               f"{[p['name'] for p in self.container.get('ports', [])]}")


class LocalRun:
    """The rendered Deployments, ConfigMaps and Services of one InferenceService."""

    def __init__(self, children: list[dict[str, Any]], root: Path) -> None:
        self.root = root
        self.config_maps = {o["metadata"]["name"]: o for o in children if o["kind"] == "ConfigMap"}
        self.services = {o["metadata"]["name"]: o for o in children if o["kind"] == "Service"}
        self.secrets = {o["metadata"]["name"]: o for o in children if o["kind"] == "Secret"}
        self.namespace = children[0]["metadata"]["namespace"]
        self.pods: list[Pod] = []
        taken: set[int] = set()
        for dep in (o for o in children if o["kind"] == "Deployment"):
            tpl = dep["spec"]["template"]
            (container,) = tpl["spec"]["containers"]
            pod = Pod(dep["metadata"]["name"], dict(tpl["metadata"]["labels"]), container,
                      {v["name"]: v for v in tpl["spec"].get("volumes", [])},
                      root / dep["metadata"]["name"])
            for p in container.get("ports", []):
                pod.ports[p["containerPort"]] = procs.free_port(None, taken)
            if container["name"] == "envoy":
                pod.ports[wire.GATEWAY_ADMIN_PORT] = procs.free_port(None, taken)
            if "--kv-events-config" in container.get("args", []):
                # every pod publishes on the same conventional ports; here they share one host
                for port in (wire.WORKER_KV_EVENTS_PORT, wire.WORKER_KV_REPLAY_PORT):
                    pod.ports[port] = procs.free_port(None, taken)
            self.pods.append(pod)

    # -- addressing -------------------------------------------------------------------
    def pod(self, component: str) -> Pod:
        return next(p for p in self.pods if p.labels.get(wire.COMPONENT_LABEL) == component)

    def service_address(self, name: str, port: int) -> str:
        """`127.0.0.1:<local>` for Service `name`'s `port`, through its selector and
        targetPort, as kube-proxy would route it."""
        svc = self.services.get(name)
        if svc is None:
            raise RenderedRunError(f"no Service {name}")
        sp = next((p for p in svc["spec"]["ports"] if p["port"] == port), None)
        if sp is None:
            raise RenderedRunError(f"Service {name} has no port {port}")
        sel = svc["spec"]["selector"]
        pods = [p for p in self.pods if sel.items() <= p.labels.items()]
        if not pods:
            raise RenderedRunError(f"Service {name} selects no pod ({sel})")
        return f"127.0.0.1:{pods[0].port(sp.get('targetPort', port))}"

    def _dns(self, host: str, port: int) -> str | None:
        m = re.fullmatch(rf"([a-z0-9-]+)\.{re.escape(self.namespace)}\.svc(\.cluster\.local)?",
                         host)
        return self.service_address(m.group(1), port) if m else None

    # -- files ---------------------------------------------------------------------
    def _mounts(self, pod: Pod) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for m in pod.container.get("volumeMounts", []):
            vol = pod.volumes.get(m["name"])
            if vol is None:
                raise RenderedRunError(f"{pod.name}: mount {m['name']} has no volume")
            local = pod.root / m["mountPath"].lstrip("/")
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in vol:
                cm = self.config_maps.get(vol["configMap"]["name"])
                if cm is None:
                    raise RenderedRunError(f"{pod.name}: no ConfigMap {vol['configMap']['name']}")
                for key, text in cm["data"].items():
                    (local / key).write_text(self._rewrite_file(pod, text))
            elif "secret" in vol:
                sec = self.secrets.get(vol["secret"]["secretName"])
                if sec is None:
                    raise RenderedRunError(f"{pod.name}: no Secret {vol['secret']['secretName']}")
                for key, b64 in sec.get("data", {}).items():
                    (local / key).write_bytes(base64.b64decode(b64))
                    (local / key).chmod(vol["secret"].get("defaultMode", 0o644))
            elif "emptyDir" not in vol:
                raise RenderedRunError(f"{pod.name}: volume {m['name']} cannot run locally")
            out[m["mountPath"]] = local
        return out

    def _rewrite_file(self, pod: Pod, text: str) -> str:
        doc = yaml.safe_load(text)
        if not (isinstance(doc, dict) and "static_resources" in doc):
            return text  # only Envoy's bootstrap holds addresses

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                sa = node.get("socket_address")
                if isinstance(sa, dict):
                    host, port = sa["address"], int(sa["port_value"])
                    target = self._dns(host, port)
                    if target is None and host in ("0.0.0.0", "127.0.0.1") and port in pod.ports:
                        target = f"127.0.0.1:{pod.ports[port]}"
                    if target is not None:
                        h, _, p = target.rpartition(":")
                        sa.update(address=h, port_value=int(p))
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)
        walk(doc)
        return yaml.safe_dump(doc, sort_keys=False)

    # -- commands --------------------------------------------------------------------
    @staticmethod
    def _paths(value: str, mounts: dict[str, Path]) -> str:
        for mount in sorted(mounts, key=len, reverse=True):
            if value == mount or value.startswith(mount + "/"):
                return str(mounts[mount]) + value[len(mount):]
        return value

    def _args(self, pod: Pod, mounts: dict[str, Path]) -> list[str]:
        args, out = list(pod.container.get("args", [])), []
        i = 0
        while i < len(args):
            a = args[i]
            if a in _K8S_FLAGS:  # discovery from the API: replaced below
                i += 2
                continue
            nxt = args[i + 1] if i + 1 < len(args) else None
            if a == "--kv-events-config" and nxt:
                out += [a, re.sub(r"tcp://\*:(\d+)",
                                  lambda m: f"tcp://127.0.0.1:{pod.ports.get(int(m.group(1)), m.group(1))}",
                                  nxt)]
                i += 2
                continue
            if a.startswith("--") and a.endswith("port") and nxt and nxt.isdigit() \
                    and int(nxt) in pod.ports:
                out += [a, str(pod.ports[int(nxt)])]
                i += 2
                continue
            out.append("127.0.0.1" if a == "0.0.0.0" else self._paths(a, mounts))
            i += 1
        if any(a in _K8S_FLAGS for a in args):
            out += ["--endpoints-file", str(self._endpoints_file(pod))]
        return out

    def _endpoints_file(self, pod: Pod) -> Path:
        """The workers as the EPP's Kubernetes discovery would see them: address, role,
        pool, and the KV-event ports their annotations name (here, each pod's own)."""
        def events(w: Pod) -> dict[str, str]:
            if wire.WORKER_KV_EVENTS_PORT not in w.ports:
                return {}
            return {"kv_events": f"tcp://127.0.0.1:{w.ports[wire.WORKER_KV_EVENTS_PORT]}",
                    "kv_events_replay": f"tcp://127.0.0.1:{w.ports[wire.WORKER_KV_REPLAY_PORT]}"}

        rows = [{"address": f"127.0.0.1:{w.port('http')}",
                 "role": w.labels.get(wire.ROLE_LABEL, "both"),
                 **({"pool": w.labels[wire.POOL_LABEL]} if wire.POOL_LABEL in w.labels else {}),
                 **events(w)}
                for w in self.pods if w.labels.get(wire.COMPONENT_LABEL) == "worker"]
        path = pod.root / "endpoints.yaml"
        path.write_text(yaml.safe_dump(rows))
        return path

    def _env(self, pod: Pod, mounts: dict[str, Path]) -> dict[str, str]:
        env = {}
        for e in pod.container.get("env", []):
            if "value" in e:
                env[e["name"]] = self._paths(e["value"], mounts)
                continue
            ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if ref == "status.podIP":
                env[e["name"]] = "127.0.0.1"
            elif ref == "metadata.namespace":
                env[e["name"]] = self.namespace
            else:
                raise RenderedRunError(f"{pod.name}: env {e['name']} cannot be filled locally")
        return env

    def command(self, pod: Pod) -> tuple[list[str], dict[str, str]]:
        mounts = self._mounts(pod)
        exe = {"kvyard": [sys.executable, "-m", "kvyard.cli"], "envoy": [str(envoy_binary())]}
        (prog,) = pod.container["command"]
        if prog not in exe:
            raise RenderedRunError(f"{pod.name}: no local {prog!r}")
        return exe[prog] + self._args(pod, mounts), self._env(pod, mounts)

    # -- probes ----------------------------------------------------------------------
    def probe(self, pod: Pod, probe: dict[str, Any]) -> bool:
        if "httpGet" in probe:
            g = probe["httpGet"]
            return procs.http_ok(f"http://127.0.0.1:{pod.port(g['port'])}{g['path']}")
        if "grpc" in probe:
            return _grpc_serving(pod.port(probe["grpc"]["port"]))
        if "tcpSocket" in probe:
            return procs.tcp_ok(pod.port(probe["tcpSocket"]["port"]))
        cmd = [sys.executable if c == "python3" else c for c in probe["exec"]["command"]]
        cmd = [re.sub(r"127\.0\.0\.1:(\d+)",
                      lambda m: f"127.0.0.1:{pod.ports.get(int(m.group(1)), m.group(1))}", c)
               for c in cmd]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0

    # -- lifecycle -------------------------------------------------------------------
    def start(self, order: tuple[str, ...] = ("worker", "epp", "gateway"),
              timeout_s: float = 180.0) -> None:
        for component in order:
            group = [p for p in self.pods if p.labels.get(wire.COMPONENT_LABEL) == component]
            for pod in group:
                cmd, env = self.command(pod)
                (pod.root / "cmd").write_text(shlex.join(cmd))
                pod.proc = procs.spawn(pod.name, cmd, pod.root / "log", env=env)
            procs.wait_ready([(p.proc, lambda p=p: self.probe(p, p.container["readinessProbe"]))
                              for p in group], timeout_s)

    def stop(self) -> None:
        procs.stop([p.proc.pid for p in reversed(self.pods) if p.proc is not None])


def _grpc_serving(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=1.0)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING

