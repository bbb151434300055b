"""What every rendered child shares: names, labels, owner reference, pod hardening.

Pure functions of the ServiceSpec; nothing here talks to an API.
"""
from __future__ import annotations

import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kvyard.common import wire

from .spec import Download, ServiceSpec

VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
MODEL_MOUNT = "/models"
CONFIG_MOUNT = "/etc/kvyard"
_GRPC_PORTS = ("ext-proc", "scaler")   # gRPC over cleartext HTTP/2


def kvyard_version() -> str:
    try:
        return version("kvyard")
    except PackageNotFoundError:
        return "0.1.0"


def default_image(s: ServiceSpec) -> str:
    """kvyard's image: the operator's `--image` (the chart's), else this version's."""
    return s.defaults.image or f"{wire.IMAGE_REPOSITORY}:{kvyard_version()}"


def cuda_image(s: ServiceSpec) -> str:
    """kvyard's CUDA variant: the operator's `--cuda-image` (the chart derives it from the same
    tag or digest values as `--image`), else `--image`, else this version's `-cuda` tag."""
    d = s.defaults
    return d.cuda_image or d.image or f"{wire.IMAGE_REPOSITORY}:{kvyard_version()}-cuda"


def worker_image(s: ServiceSpec) -> str:
    if s.engine.image:
        return s.engine.image
    if s.engine.name == "vllm":
        return VLLM_IMAGE
    return cuda_image(s) if s.engine.device == "cuda" else default_image(s)


def service_host(s: ServiceSpec, name: str) -> str:
    """A Service's fully qualified name in the operator's cluster domain."""
    return f"{name}.{s.namespace}.svc.{s.defaults.cluster_domain}"


def name_of(s: ServiceSpec, component: str, role: str | None = None) -> str:
    """`<service>-<role>` for worker pools, `<service>-epp`, `<service>-gateway`."""
    return f"{s.name}-{role if component == 'worker' else component}"


def selector_labels(s: ServiceSpec, component: str, role: str | None = None) -> dict[str, str]:
    labels = {wire.SERVICE_LABEL: s.name, wire.COMPONENT_LABEL: component}
    if role is not None:
        labels[wire.ROLE_LABEL] = role
    return labels


def labels(s: ServiceSpec, component: str, role: str | None = None) -> dict[str, str]:
    return {wire.MANAGED_BY_LABEL: wire.MANAGED_BY, "app.kubernetes.io/name": "kvyard",
            "app.kubernetes.io/instance": s.name,
            "app.kubernetes.io/component": component if role is None else f"{component}-{role}",
            **selector_labels(s, component, role)}


def owner_reference(s: ServiceSpec) -> dict[str, Any]:
    return {"apiVersion": f"{wire.K8S_GROUP}/{wire.CRD_VERSION}", "kind": wire.CRD_KIND,
            "name": s.name, "uid": s.uid, "controller": True, "blockOwnerDeletion": True}


def metadata(s: ServiceSpec, name: str, component: str, role: str | None = None,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    md: dict[str, Any] = {"name": name, "namespace": s.namespace,
                          "labels": labels(s, component, role),
                          "ownerReferences": [owner_reference(s)]}
    if annotations:
        md["annotations"] = annotations
    return md


def container_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": wire.RUN_AS_USER, "runAsGroup": wire.RUN_AS_USER,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": wire.RUN_AS_USER, "runAsGroup": wire.RUN_AS_USER,
            "fsGroup": wire.RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}}


def scratch_volumes(names: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """emptyDirs for the paths a read-only root filesystem still needs written."""
    vols = [{"name": n, "emptyDir": {}} for n in names]
    mounts = [{"name": n, "mountPath": p} for n, p in names.items()]
    return vols, mounts


def model_volume(s: ServiceSpec) -> tuple[list[dict], list[dict], str]:
    """(volumes, mounts, the --model argument) for the spec's model source."""
    m = s.model
    if m.source == "demo":
        return [], [], "demo"
    if m.source in ("hf", "gguf"):
        return [], [], str(m.path)
    if m.source == "pvc":
        vol = {"name": "model", "persistentVolumeClaim": {"claimName": m.claim_name,
                                                          "readOnly": True}}
    elif m.download is not None:
        vol = {"name": "model", **_download_volume(m.download)}
    else:
        vol = {"name": "model", "image": {"reference": m.image,
                                          "pullPolicy": m.image_pull_policy}}
    inner = (m.path or "").strip("/")
    arg = f"{MODEL_MOUNT}/{inner}" if inner else MODEL_MOUNT
    return [vol], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}], arg


def _download_volume(d: Download) -> dict[str, Any]:
    if d.storage_class:
        return {"ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": d.storage_class,
            "resources": {"requests": {"storage": d.size}}}}}}
    return {"emptyDir": {"sizeLimit": d.size}}


_DOWNLOAD = ("import json, os\n"
             "from huggingface_hub import snapshot_download\n"
             "snapshot_download(os.environ['KVYARD_MODEL_REPO'],"
             " revision=os.environ['KVYARD_MODEL_REVISION'],"
             " local_dir=os.environ['KVYARD_MODEL_DIR'],"
             " allow_patterns=json.loads(os.environ['KVYARD_MODEL_ALLOW']) or None)\n")


def model_download(s: ServiceSpec) -> dict[str, Any] | None:
    """source download: the init container that fetches the repository into the model volume
    (run with the workers' own image, already on the node: kvyard's and vLLM's both carry
    huggingface_hub); the workers then read it like a PVC."""
    d = s.model.download
    if d is None:
        return None
    env: list[dict[str, Any]] = [
        {"name": "KVYARD_MODEL_REPO", "value": d.repo},
        {"name": "KVYARD_MODEL_REVISION", "value": d.revision},
        {"name": "KVYARD_MODEL_DIR", "value": MODEL_MOUNT},
        {"name": "KVYARD_MODEL_ALLOW", "value": json.dumps(d.allow_patterns)},
        # the image is offline by default; this one container is not
        {"name": "HF_HUB_OFFLINE", "value": "0"}, {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}, {"name": "HOME", "value": "/tmp"}]
    if d.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": d.endpoint})
    if d.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": d.token_secret, "key": d.token_key}}})
    return {"name": "model-download", "image": worker_image(s),
            "imagePullPolicy": s.defaults.pull_policy, "command": ["python3", "-c", _DOWNLOAD],
            "env": env,
            "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT},
                             {"name": "tmp", "mountPath": "/tmp"}],
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                          "limits": {"memory": "2Gi"}},
            "securityContext": container_security()}


def http_probe(path: str, port: int | str, **kw: Any) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, **kw}


def _pod_identity(s: ServiceSpec) -> dict[str, Any]:
    """The operator's pull secrets and ServiceAccount for every pod (the EPP's pod names
    its own ServiceAccount, which wins)."""
    out: dict[str, Any] = {}
    if s.defaults.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in s.defaults.image_pull_secrets]
    if s.defaults.service_account:
        out["serviceAccountName"] = s.defaults.service_account
    return out


def deployment(s: ServiceSpec, name: str, component: str, role: str | None,
               pod: dict[str, Any], replicas: int | None,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """replicas None: left out, so an autoscaler owns the field (server-side apply
    would otherwise set it back on every pass)."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(s, component, role)},
        "revisionHistoryLimit": 3,
        "template": {"metadata": {"labels": labels(s, component, role),
                                  **({"annotations": annotations} if annotations else {})},
                     "spec": {"securityContext": pod_security(),
                              "automountServiceAccountToken": component == "epp",
                              **_pod_identity(s), **pod}},
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(s, name, component, role), "spec": spec}


def spread(s: ServiceSpec, component: str, role: str | None = None) -> list[dict[str, Any]]:
    """Replicas on different nodes where the scheduler can (never blocks scheduling)."""
    return [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
             "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": selector_labels(s, component, role)}}]


def service(s: ServiceSpec, name: str, component: str, role: str | None,
            ports: list[tuple[str, int]], headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": selector_labels(s, component, role),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP",
                   **({"appProtocol": "kubernetes.io/h2c"} if n in _GRPC_PORTS else {})}
                  for n, p in ports]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(s, name, component, role), "spec": spec}


def digest(text: str) -> str:
    """A pod-template annotation of a mounted config's hash: a config change rolls the
    pods that read it once at start."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
