"""The pure renderers: exact children, labels, owner references, ports, probes,
hardening; every container's args accepted by the real `kvyard worker` / `kvyard epp`
parsers; the scheduler config accepted by the EPP's loader; the Envoy bootstrap the
one `kvyard gateway-config` renders, accepted by Envoy; every object valid for
Kubernetes 1.33."""
from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvyard.cli import build_parser
from kvyard.common import wire
from kvyard.gateway.config import render_yaml
from kvyard.gateway.envoy import envoy_binary
from kvyard.operator import render_gateway
from kvyard.operator.render import render_all
from kvyard.operator.spec import parse

UID = "0b6f3a52-1c1e-4a57-9d7e-5f1c2d3e4f50"
EXAMPLES = Path(__file__).resolve().parents[2] / "operator" / "examples"


def svc(spec: dict, name: str = "demo") -> object:
    return parse({"metadata": {"name": name, "namespace": "team-a", "uid": UID,
                               "generation": 3}, "spec": spec})


def by_kind(children: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in children if o["kind"] == kind}


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


CPU = {"model": {"source": "demo"}, "kvstore": {"dramGB": 1}}
PD = {"pools": {"prefill": {"replicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 3,
                                                        "replicas": 2}},
      "routing": {"pd": {"nonCachedTokens": 128}}}


def test_exact_children_for_a_cpu_demo_service() -> None:
    kinds = [(o["kind"], o["metadata"]["name"]) for o in render_all(svc(CPU))]
    assert kinds == [
        ("Deployment", "demo-both"), ("Service", "demo-both"),
        ("ServiceAccount", "demo-epp"), ("Role", "demo-epp"), ("RoleBinding", "demo-epp"),
        ("ConfigMap", "demo-epp"), ("Deployment", "demo-epp"), ("Service", "demo-epp"),
        ("ConfigMap", "demo-gateway"), ("Deployment", "demo-gateway"),
        ("Service", "demo-gateway")]


@pytest.mark.parametrize("spec", [CPU, PD, {"inferencePool": {"enabled": True}},
                                  {"scaleToZero": {"enabled": True},
                                   "pools": {"both": {"minReplicas": 0, "maxReplicas": 3}}}],
                         ids=["cpu", "pd", "pool", "stz"])
def test_labels_owner_references_and_kubernetes_schemas(spec: dict) -> None:
    for obj in render_all(svc(spec)):
        md = obj["metadata"]
        assert md["namespace"] == "team-a"
        assert md["ownerReferences"] == [{
            "apiVersion": "kvyard.io/v1alpha1", "kind": "InferenceService", "name": "demo",
            "uid": UID, "controller": True, "blockOwnerDeletion": True}]
        labels = md["labels"]
        assert labels[wire.MANAGED_BY_LABEL] == "kvyard-operator"
        assert labels[wire.SERVICE_LABEL] == "demo"
        assert labels[wire.COMPONENT_LABEL] in wire.COMPONENTS
        if labels[wire.COMPONENT_LABEL] == "worker":
            assert labels[wire.ROLE_LABEL] in wire.ROLES
        if obj["kind"] in ("InferencePool", "ScaledObject"):
            continue  # not in Kubernetes' schemas; their shapes are checked exactly elsewhere
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_pods_are_hardened_and_probed() -> None:
    children = render_all(svc(CPU))
    deps = by_kind(children, "Deployment")
    for dep in deps.values():
        pod = dep["spec"]["template"]["spec"]
        sel = dep["spec"]["selector"]["matchLabels"]
        assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        c = container(dep)
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["runAsUser"] == 65532 and sc["readOnlyRootFilesystem"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and not sc["allowPrivilegeEscalation"]
        assert pod["securityContext"]["runAsUser"] == 65532
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in vols[mounts["/tmp"]]
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= c.keys()
    w, e, g = (container(deps[n]) for n in ("demo-both", "demo-epp", "demo-gateway"))
    assert w["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in w["ports"]} == {"http": 8000}
    assert e["readinessProbe"]["grpc"] == {"port": 9003}
    assert {p["name"]: p["containerPort"] for p in e["ports"]} == \
        {"ext-proc": 9002, "health": 9003, "metrics": 9090, "scaler": 9004}
    assert "127.0.0.1:9901/ready" in g["readinessProbe"]["exec"]["command"][-1]
    assert {p["name"]: p["containerPort"] for p in g["ports"]} == {"http": 8080}
    assert w["image"] == e["image"] == g["image"] == "ghcr.io/kvyard/kvyard:0.1.0"
    assert (w["command"], e["command"], g["command"]) == (["kvyard"], ["kvyard"], ["envoy"])


def test_services_select_their_pods_by_named_ports() -> None:
    children = render_all(svc(PD))
    deps = by_kind(children, "Deployment")
    for name, service in by_kind(children, "Service").items():
        dep = deps[name]
        assert service["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        named = {p["name"]: p["containerPort"] for p in container(dep)["ports"]}
        for port in service["spec"]["ports"]:
            assert named[port["targetPort"]] == port["port"]
    assert by_kind(children, "Service")["demo-decode"]["spec"]["clusterIP"] == "None"


def parse_cli(c: dict):
    args = c["args"]
    return build_parser(args).parse_args(args)


def test_worker_args_are_accepted_by_kvyard_worker() -> None:
    s = svc({**CPU, "engine": {"maxModelLen": 2048, "kvCacheMemory": "512Mi", "blockSize": 32},
             "model": {"source": "demo", "servedModelName": "smol"},
             "kvstore": {"dramGB": 2, "ssd": {"size": "4Gi"},
                         "redis": {"url": "redis://r:6379", "secretRef": {"name": "rs"}}}})
    c = container(by_kind(render_all(s), "Deployment")["demo-both"])
    a = parse_cli(c)
    assert (a.command, a.model, a.host, a.port, a.role, a.device) == \
        ("worker", "demo", "0.0.0.0", 8000, "both", "cpu")
    assert (a.max_model_len, a.kv_cache_memory_bytes, a.block_size) == (2048, 512 << 20, 32)
    assert a.served_model_name == ["smol"]
    assert (a.kv_dram_gb, a.kv_ssd_gb, a.kv_redis_url) == (2.0, 4 * 2**30 / 1e9, "redis://r:6379")
    env = {e["name"]: e for e in c["env"]}
    assert env[wire.REDIS_PASSWORD_ENV]["valueFrom"] == {"secretKeyRef": {"name": "rs",
                                                                           "key": "password"}}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert a.kv_ssd_dir in mounts


def test_epp_args_config_and_rbac() -> None:
    children = render_all(svc(CPU))
    dep = by_kind(children, "Deployment")["demo-epp"]
    c = container(dep)
    a = parse_cli(c)
    assert (a.command, a.k8s_namespace, a.k8s_selector, a.target_port) == \
        ("epp", "team-a", "kvyard.io/service=demo,kvyard.io/component=worker", 8000)
    assert (a.ext_proc_port, a.health_port, a.metrics_port) == (9002, 9003, 9090)
    assert a.destination_fallbacks == 2 and a.pd_key_file is None
    cm = by_kind(children, "ConfigMap")["demo-epp"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    (key,) = cm["data"]
    assert a.config == f"{mount['mountPath']}/{key}"
    from kvyard.epp.scheduling.config import build_scheduler
    build_scheduler(yaml.safe_load(cm["data"][key]))
    role = by_kind(children, "Role")["demo-epp"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "demo-epp"
    assert dep["spec"]["template"]["metadata"]["annotations"]["kvyard.io/config-hash"]


def test_pd_renders_the_split_scheduler_and_the_shared_key() -> None:
    children = render_all(svc(PD))
    deps = by_kind(children, "Deployment")
    assert set(deps) == {"demo-prefill", "demo-decode", "demo-epp", "demo-gateway"}
    assert deps["demo-decode"]["spec"]["replicas"] == 2
    epp = parse_cli(container(deps["demo-epp"]))
    cm = yaml.safe_load(by_kind(children, "ConfigMap")["demo-epp"]["data"]["scheduler.yaml"])
    assert cm["profileHandler"]["type"] == "disagg-profile-handler"
    assert cm["profileHandler"]["nonCachedTokens"] == 128
    from kvyard.epp.scheduling.config import build_scheduler
    build_scheduler(cm)
    for name, role in (("demo-prefill", "prefill"), ("demo-decode", "decode")):
        c = container(deps[name])
        a = parse_cli(c)
        assert a.role == role
        assert (a.kv_peer_port == wire.WORKER_KV_PEER_PORT) == (role == "prefill")
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[wire.PD_KEY_ENV] == epp.pd_key_file
        mount = next(m for m in c["volumeMounts"] if m["name"] == "pd-key")
        assert epp.pd_key_file.startswith(mount["mountPath"] + "/")
        vol = next(v for v in deps[name]["spec"]["template"]["spec"]["volumes"]
                   if v["name"] == "pd-key")
        assert vol["secret"]["secretName"] == "demo-pd-key"


def test_scale_to_zero_leaves_replicas_to_the_autoscaler() -> None:
    s = svc({"scaleToZero": {"enabled": True},
             "pools": {"both": {"minReplicas": 0, "maxReplicas": 3}}})
    deps = by_kind(render_all(s), "Deployment")
    assert "replicas" not in deps["demo-both"]["spec"]
    assert deps["demo-epp"]["spec"]["replicas"] == 1
    assert deps["demo-gateway"]["spec"]["replicas"] == 2  # the default: stateless, two


def test_vllm_pods_run_vllm_serve_from_an_image_volume() -> None:
    obj = yaml.safe_load((EXAMPLES / "vllm.yaml").read_text())
    children = render_all(svc(obj["spec"], "qwen"))
    dep = by_kind(children, "Deployment")["qwen-decode"]
    c = container(dep)
    assert c["command"] == ["vllm"] and c["image"].startswith("vllm/vllm-openai:")
    assert c["args"][:2] == ["serve", "/models/Qwen2.5-7B-Instruct"]
    assert "--kv-cache-memory-bytes" in c["args"] and "--served-model-name" in c["args"]
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert vol["image"]["reference"].endswith("qwen2.5-7b-instruct:1")
    epp = parse_cli(container(by_kind(children, "Deployment")["qwen-epp"]))
    assert epp.model == "/models/Qwen2.5-7B-Instruct"  # the EPP tokenizes from the same volume


def test_inference_pool_points_at_the_epp() -> None:
    children = render_all(svc({"inferencePool": {"enabled": True}}))
    (pool,) = [o for o in children if o["kind"] == "InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"kvyard.io/service": "demo",
                                     "kvyard.io/component": "worker"}},
        "targetPorts": [{"number": 8000}], "appProtocol": "http",
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "demo-epp",
                              "port": {"number": 9002}, "failureMode": "FailClose"}}


def test_gateway_config_is_kvyard_gateway_configs_and_envoy_accepts_it(tmp_path: Path) -> None:
    s = svc(CPU)
    children = render_all(s)
    cm = by_kind(children, "ConfigMap")["demo-gateway"]
    text = cm["data"]["envoy.yaml"]
    assert text == render_yaml(render_gateway.gateway_config(s))
    doc = yaml.safe_load(text)
    epp = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "kvyard_epp")
    assert epp["type"] == "STRICT_DNS"
    addr = epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert addr["socket_address"] == {"address": "demo-epp.team-a.svc", "port_value": 9002}
    assert doc["admin"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                         "port_value": 9901}
    c = container(by_kind(children, "Deployment")["demo-gateway"])
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert c["args"][c["args"].index("-c") + 1] == f"{mount['mountPath']}/envoy.yaml"
    conf = tmp_path / "envoy.yaml"
    conf.write_text(text)
    out = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(conf)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_operator_rbac_covers_every_call_and_is_a_valid_role() -> None:
    from kvyard.operator import rbac
    from kvyard.operator.client import KINDS

    for kind in ("ClusterRole", "Role"):
        kubernetes_validate.validate({**rbac.role(kind), "metadata": {
            "name": "kvyard-operator", **({"namespace": "x"} if kind == "Role" else {})}},
            "1.33", strict=True)
    granted = {(g, r): set(rule["verbs"]) for rule in rbac.RULES
               for g in rule["apiGroups"] for r in rule["resources"]}
    for kind, (api, plural) in KINDS.items():
        group = api.rpartition("/")[0]
        assert (group, plural) in granted, kind
    # Children the operator applies: apply = get + create + patch; pruned kinds: list + delete.
    for kind in ("Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
                 "InferencePool"):
        api, plural = KINDS[kind]
        assert {"get", "list", "create", "patch", "delete"} <= \
            granted[(api.rpartition("/")[0], plural)]
    assert granted[("", "secrets")] == {"get", "create"}
    assert granted[("", "pods")] == {"get", "list", "watch"}  # what the EPP's Role grants


def test_the_operators_image_and_gpu_placement() -> None:
    from kvyard.operator.spec import Defaults

    cr = {"metadata": {"name": "demo", "namespace": "team-a", "uid": UID},
          "spec": {"engine": {"device": "cuda", "nodeSelector": {"gpu": "h200"},
                              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                               "effect": "NoSchedule"}]}}}
    children = render_all(parse(cr, Defaults("kind.local/kvyard:dev", "Never")))
    for dep in by_kind(children, "Deployment").values():
        c = container(dep)
        assert (c["image"], c["imagePullPolicy"]) == ("kind.local/kvyard:dev", "Never")
        kubernetes_validate.validate(dep, "1.33", strict=True)
    pod = by_kind(children, "Deployment")["demo-both"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert container(by_kind(children, "Deployment")["demo-both"])["resources"]["limits"] == \
        {"nvidia.com/gpu": 1}
    assert "nodeSelector" not in by_kind(children, "Deployment")["demo-epp"]["spec"][
        "template"]["spec"]


def test_kvyard_operator_is_a_subcommand(monkeypatch) -> None:
    monkeypatch.setenv("KVYARD_IMAGE", "reg.example/kvyard:1")
    a = build_parser(["operator"]).parse_args(["operator", "--namespace", "a",
                                               "--namespace", "b", "--resync-seconds", "10"])
    assert (a.namespace, a.resync_seconds, a.image, a.image_pull_policy) == \
        (["a", "b"], 10.0, "reg.example/kvyard:1", "IfNotPresent")
