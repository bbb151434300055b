"""spec.epp.replicas: N EPP pods that find each other through a headless Service, and a
gateway whose EPP cluster is that Service (STRICT_DNS: one host per pod), health-checked
and retrying a failed ext_proc stream on another replica. One replica renders as before."""
from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

from kvyard.cli import build_parser
from kvyard.common import wire
from kvyard.gateway.config import EPP_CLUSTER, render_yaml
from kvyard.gateway.envoy import envoy_binary
from kvyard.operator import render_gateway
from kvyard.operator.render import render_all
from kvyard.operator.render_epp import REPLICA_PORT

from .test_render import by_kind, container, svc


def test_two_epp_replicas_render_peers_a_headless_service_and_a_balanced_gateway(
        tmp_path: Path) -> None:
    s = svc({"epp": {"replicas": 2}})
    children = render_all(s)
    dep = by_kind(children, "Deployment")["demo-epp"]
    assert dep["spec"]["replicas"] == 2
    args = container(dep)["args"]
    host = "demo-epp-replicas.team-a.svc.cluster.local"
    assert args[args.index("--peers-dns") + 1] == f"{host}:{REPLICA_PORT}"
    assert args[args.index("--replica-port") + 1] == str(REPLICA_PORT)
    ns = build_parser(args).parse_args(args)  # the EPP's own parser accepts them
    assert ns.peers_dns == f"{host}:{REPLICA_PORT}"
    headless = by_kind(children, "Service")["demo-epp-replicas"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in headless["spec"]["ports"]} >= {REPLICA_PORT, REPLICA_PORT + 1,
                                                             wire.EPP_EXT_PROC_PORT}
    for obj in (dep, headless):
        kubernetes_validate.validate({k: v for k, v in obj.items()}, "1.33", strict=True)

    doc = yaml.safe_load(render_gateway.render_gateway(s)[0]["data"]["envoy.yaml"])
    cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == EPP_CLUSTER)
    assert cluster["type"] == "STRICT_DNS"
    [ep] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"]["address"] == host
    assert ep["endpoint"]["health_check_config"]["port_value"] == wire.EPP_HEALTH_PORT
    assert cluster["health_checks"][0]["grpc_health_check"] == {"service_name": "readiness"}
    conf = tmp_path / "envoy.yaml"
    conf.write_text(render_yaml(render_gateway.gateway_config(s)))
    out = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(conf)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_one_epp_replica_renders_no_replica_parts() -> None:
    children = render_all(svc({}))
    assert by_kind(children, "Deployment")["demo-epp"]["spec"]["replicas"] == 1
    assert "--peers-dns" not in container(by_kind(children, "Deployment")["demo-epp"])["args"]
    assert "demo-epp-replicas" not in by_kind(children, "Service")
    doc = yaml.safe_load(render_gateway.render_gateway(svc({}))[0]["data"]["envoy.yaml"])
    cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == EPP_CLUSTER)
    assert "health_checks" not in cluster
