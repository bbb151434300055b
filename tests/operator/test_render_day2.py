"""Day-2 rendering: GPU placement and rollout, the SSD tier's volume, images and pull
secrets, ports and addresses the operator is told, and no single gateway replica. Every
object stays valid for Kubernetes 1.33."""
from __future__ import annotations

import kubernetes_validate
import pytest

from kvyard.cli import build_parser
from kvyard.operator import render_common as rc
from kvyard.operator.render import render_all
from kvyard.operator.spec import Defaults, SpecError, parse

UID = "0b6f3a52-1c1e-4a57-9d7e-5f1c2d3e4f50"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def children(spec: dict, defaults: Defaults | None = None) -> list[dict]:
    s = parse({"metadata": {"name": "demo", "namespace": "team-a", "uid": UID},
               "spec": spec}, defaults)
    out = render_all(s)
    for obj in out:
        kubernetes_validate.validate(obj, "1.33", strict=True)
    return out


def deployments(objs: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}


def pod(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def worker(dep: dict) -> dict:
    [c] = [c for c in pod(dep)["containers"] if c["name"] == "worker"]
    return c


def test_gpu_pools_tolerate_the_taint_get_shm_and_roll_one_at_a_time() -> None:
    deps = deployments(children({"engine": {
        "device": "cuda", "tolerations": [GPU_TAINT], "nodeSelector": {"gpu": "yes"},
        "priorityClassName": "serving", "startupSeconds": 3600,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}]}]}}}}}))
    w = deps["demo-both"]
    p = pod(w)
    assert p["tolerations"] == [GPU_TAINT] and p["priorityClassName"] == "serving"
    assert p["affinity"]["nodeAffinity"]
    assert w["spec"]["strategy"] == {"type": "RollingUpdate",
                                     "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    [shm] = [v for v in p["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in worker(w)["volumeMounts"]
    probe = worker(w)["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 3600
    # the control plane is not placed on GPU nodes by the workers' settings
    for name in ("demo-epp", "demo-gateway"):
        assert not {"tolerations", "priorityClassName", "affinity"} & pod(deps[name]).keys()


def test_cpu_pools_keep_the_default_rollout_and_a_ten_minute_budget() -> None:
    w = deployments(children({}))["demo-both"]
    assert "strategy" not in w["spec"]
    assert not [v for v in pod(w)["volumes"] if v["name"] == "shm"]
    probe = worker(w)["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 600
    with pytest.raises(SpecError, match="startupSeconds"):
        parse({"metadata": {"name": "d", "uid": UID}, "spec": {"engine": {"startupSeconds": 9}}})


def _ssd(objs: list[dict]) -> tuple[dict, dict]:
    p = pod(deployments(objs)["demo-both"])
    [vol] = [v for v in p["volumes"] if v["name"] == "kv-ssd"]
    return vol, p


def test_the_ssd_tier_is_an_empty_dir_unless_told_otherwise() -> None:
    vol, p = _ssd(children({"kvstore": {"ssd": {"size": "4Gi"}}}))
    assert vol == {"name": "kv-ssd", "emptyDir": {"sizeLimit": str(4 << 30)}}
    assert "initContainers" not in p
    vol, _ = _ssd(children({"kvstore": {"ssd": {"size": "1Gi", "medium": "Memory"}}}))
    assert vol["emptyDir"] == {"sizeLimit": str(1 << 30), "medium": "Memory"}
    vol, _ = _ssd(children({"kvstore": {"ssd": {"size": "8Gi", "storageClassName": "local"}}}))
    claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local"
    assert claim["resources"]["requests"]["storage"] == str(8 << 30)
    with pytest.raises(SpecError, match="not both"):
        children({"kvstore": {"ssd": {"size": "1Gi", "path": "/mnt", "storageClassName": "x"}}})


def test_a_host_path_ssd_tier_is_handed_to_the_workers_uid_first() -> None:
    vol, p = _ssd(children({"kvstore": {"ssd": {"size": "4Gi", "path": "/mnt/nvme/kv"}}}))
    assert vol["hostPath"]["path"] == "/mnt/nvme/kv"
    [init] = p["initContainers"]
    assert "chown 65532:65532" in init["command"][-1]
    assert init["volumeMounts"] == [{"name": "kv-ssd", "mountPath": "/var/cache/kvyard-kv"}]
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["capabilities"] == {"drop": ["ALL"],
                                                           "add": ["CHOWN", "FOWNER"]}
    assert sc["allowPrivilegeEscalation"] is False


def test_images_pull_secrets_and_service_account_reach_every_pod() -> None:
    d = Defaults("reg.example/kvyard:2.0@sha256:" + "a" * 64, "Always",
                 cuda_image="reg.example/kvyard:2.0-cuda", image_pull_secrets=["regcred"],
                 service_account="models-reader")
    deps = deployments(children({"engine": {"device": "cuda"}}, d))
    assert worker(deps["demo-both"])["image"] == "reg.example/kvyard:2.0-cuda"
    for name in ("demo-epp", "demo-gateway"):
        assert pod(deps[name])["containers"][0]["image"] == d.image
    for name, dep in deps.items():
        assert pod(dep)["imagePullSecrets"] == [{"name": "regcred"}], name
    assert pod(deps["demo-both"])["serviceAccountName"] == "models-reader"
    assert pod(deps["demo-gateway"])["serviceAccountName"] == "models-reader"
    assert pod(deps["demo-epp"])["serviceAccountName"] == "demo-epp"  # it lists pods
    # without an operator image: this version's -cuda tag on GPU workers, the plain one elsewhere
    deps = deployments(children({"engine": {"device": "cuda"}}))
    assert worker(deps["demo-both"])["image"] == f"ghcr.io/kvyard/kvyard:{rc.kvyard_version()}-cuda"
    assert pod(deps["demo-epp"])["containers"][0]["image"] == \
        f"ghcr.io/kvyard/kvyard:{rc.kvyard_version()}"
    assert "imagePullSecrets" not in pod(deps["demo-both"])


def test_the_kv_peer_port_is_the_one_the_operator_is_told() -> None:
    d = Defaults(kv_peer_port=9123)
    objs = children({"pools": {"prefill": {}, "decode": {}}}, d)
    pre = deployments(objs)["demo-prefill"]
    args = worker(pre)["args"]
    assert args[args.index("--kv-peer-port") + 1] == "9123"
    assert {"name": "kv-peer", "containerPort": 9123, "protocol": "TCP"} in worker(pre)["ports"]
    [svc] = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "demo-prefill"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["kv-peer"] == 9123


def test_the_operator_reads_its_settings_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVYARD_KV_PEER_PORT", "9123")
    monkeypatch.setenv("KVYARD_CLUSTER_DOMAIN", "corp.internal")
    monkeypatch.setenv("KVYARD_CUDA_IMAGE", "reg.example/kvyard:1-cuda")
    monkeypatch.setenv("KVYARD_IMAGE_PULL_SECRETS", "a,b")
    monkeypatch.setenv("KVYARD_POD_SERVICE_ACCOUNT", "sa")
    a = build_parser(["operator"]).parse_args(["operator"])
    assert (a.kv_peer_port, a.cluster_domain, a.cuda_image, a.image_pull_secret,
            a.pod_service_account) == (9123, "corp.internal", "reg.example/kvyard:1-cuda",
                                       ["a", "b"], "sa")
    s = parse({"metadata": {"name": "x", "namespace": "n", "uid": UID}, "spec": {}},
              Defaults(cluster_domain="corp.internal"))
    assert rc.service_host(s, "x-epp") == "x-epp.n.svc.corp.internal"


def test_the_gateway_is_two_replicas_spread_over_nodes() -> None:
    deps = deployments(children({}))
    gw = deps["demo-gateway"]
    assert gw["spec"]["replicas"] == 2
    [spread] = pod(gw)["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # never blocks scheduling
    assert spread["labelSelector"]["matchLabels"] == gw["spec"]["selector"]["matchLabels"]
    assert deps["demo-epp"]["spec"]["replicas"] == 1  # per-replica state: see render_gateway
    assert deployments(children({"gateway": {"replicas": 3}}))["demo-gateway"]["spec"][
        "replicas"] == 3
    w = deps["demo-both"]
    assert pod(w)["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == \
        w["spec"]["selector"]["matchLabels"]


def test_a_hub_download_fills_the_model_volume_before_the_worker_starts(monkeypatch) -> None:
    import huggingface_hub

    objs = children({"engine": {"device": "cuda"}, "model": {"source": "download", "download": {
        "repo": "org/model", "revision": "v2", "allowPatterns": ["*.json", "*.safetensors"],
        "tokenSecretRef": {"name": "hf"}, "size": "40Gi"}}})
    deps = deployments(objs)
    p = pod(deps["demo-both"])
    [init] = p["initContainers"]
    [vol] = [v for v in p["volumes"] if v["name"] == "model"]
    assert vol == {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}}
    args = worker(deps["demo-both"])["args"]
    assert args[args.index("--model") + 1] == "/models"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in \
        worker(deps["demo-both"])["volumeMounts"]
    assert init["image"] == worker(deps["demo-both"])["image"]  # already on the node
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert env["HF_HUB_OFFLINE"]["value"] == "0"
    # the EPP does not fetch the weights: it hashes prompts as bytes
    epp = pod(deps["demo-epp"])
    assert not [v for v in epp["volumes"] if v["name"] == "model"]
    eargs = epp["containers"][0]["args"]
    assert eargs[eargs.index("--model") + 1] == "none"
    # the init script, run as the container would, asks the Hub for exactly that
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: calls.append((repo, kw)))
    for name, e in env.items():
        if "value" in e:
            monkeypatch.setenv(name, e["value"])
    exec(init["command"][-1], {})  # noqa: S102 - the rendered script itself
    assert calls == [("org/model", {"revision": "v2", "local_dir": "/models",
                                    "allow_patterns": ["*.json", "*.safetensors"]})]
    with pytest.raises(SpecError, match="Hub id"):
        children({"model": {"source": "download", "download": {"repo": "no-slash"}}})


def test_the_gateway_pods_expose_the_api_only() -> None:
    """The bootstrap in the gateway's ConfigMap is kvyard.gateway.config's, 404 route included."""
    import yaml

    [cm] = [o for o in children({}) if o["kind"] == "ConfigMap"
            and o["metadata"]["name"] == "demo-gateway"]
    doc = yaml.safe_load(cm["data"]["envoy.yaml"])
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    statuses = [r.get("direct_response", {}).get("status") for r in routes]
    assert 404 in statuses and statuses[0] is None  # the API route first, then Envoy's own
    assert "/tokenize" in routes[0]["match"]["safe_regex"]["regex"]
