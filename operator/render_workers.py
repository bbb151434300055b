"""One Deployment + Service per pool: `kvyard worker` or stock `vllm serve` pods.

Flags are the model servers' own (a test parses kvyard's with `kvyard worker`'s
argparse parser). Workers are reached by pod IP (the EPP lists Ready pods), so
their Service is headless: a stable DNS name for tools and NetworkPolicies, never
a load-balanced path around the EPP.
"""
from __future__ import annotations

import json
from typing import Any

from kvyard.common import wire

from . import render_common as rc
from .models import adapter_volumes, lora_args
from .spec import KVStore, Pool, ServiceSpec, quantity_bytes

CACHE_DIR = "/var/cache/kvyard"
SSD_MOUNT = "/var/cache/kvyard-kv"
PD_KEY_DIR = f"{rc.CONFIG_MOUNT}/pd"
PD_KEY_FILE = f"{PD_KEY_DIR}/key"
_GB = 10**9


def pd_secret_name(s: ServiceSpec) -> str:
    return f"{s.name}-pd-key"


def _default_resources(s: ServiceSpec) -> dict[str, Any]:
    if s.engine.device == "cuda":
        return {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": 1}}
    return {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}


def _kvstore_args(s: ServiceSpec) -> list[str]:
    kv = s.kvstore
    if kv is None:
        return []
    args = ["--kv-dram-gb", f"{kv.dram_gb:g}"] if kv.dram_gb > 0 else []
    if kv.ssd_bytes:
        args += ["--kv-ssd-dir", SSD_MOUNT, "--kv-ssd-gb", str(kv.ssd_bytes / _GB)]
    if kv.redis_url:
        args += ["--kv-redis-url", kv.redis_url]
    return args


def kv_events_args() -> list[str]:
    """Every worker (kvyard's or stock vLLM's) publishes its KV events on the pod's
    conventional ports, which the pod's annotations name for the EPP (precise routing)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": f"tcp://*:{wire.WORKER_KV_EVENTS_PORT}",
           "replay_endpoint": f"tcp://*:{wire.WORKER_KV_REPLAY_PORT}"}
    return ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]


def kvyard_args(s: ServiceSpec, role: str, model_arg: str) -> list[str]:
    e = s.engine
    args = ["worker", "--model", model_arg, "--host", "0.0.0.0",
            "--port", str(wire.WORKER_HTTP_PORT), "--role", role, "--device", e.device,
            "--block-size", str(e.block_size)]
    if s.model.served_name:
        args += ["--served-model-name", s.model.served_name]
    if e.max_model_len:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.kv_cache_memory:
        args += ["--kv-cache-memory-bytes", e.kv_cache_memory]
    if s.disaggregated and role in ("prefill", "both"):
        args += ["--kv-peer-port", str(s.defaults.kv_peer_port)]
    return args + kv_events_args() + _kvstore_args(s) + lora_args(s) + e.extra_args


def vllm_args(s: ServiceSpec, model_arg: str) -> list[str]:
    e = s.engine
    args = ["serve", model_arg, "--host", "0.0.0.0", "--port", str(wire.WORKER_HTTP_PORT),
            "--block-size", str(e.block_size), "--enable-prefix-caching"]
    if s.model.served_name:
        args += ["--served-model-name", s.model.served_name]
    if e.max_model_len:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.kv_cache_memory:
        args += ["--kv-cache-memory-bytes", str(quantity_bytes(e.kv_cache_memory))]
    return args + kv_events_args() + lora_args(s) + e.extra_args


def _env(s: ServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "KVYARD_CACHE_DIR", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        # The built-weights cache pays off across starts on one disk; a pod's emptyDir is
        # new every start, so writing it would only cost ephemeral storage.
        {"name": "KVYARD_WEIGHT_CACHE", "value": "0"},
    ]
    if s.engine.name == "vllm":
        env += [{"name": "HF_HUB_OFFLINE", "value": "1"},
                {"name": "VLLM_NO_USAGE_STATS", "value": "1"}]
    if s.kvstore is not None and s.kvstore.redis_secret:
        env.append({"name": wire.REDIS_PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
            "name": s.kvstore.redis_secret, "key": s.kvstore.redis_secret_key}}})
    if s.disaggregated:
        env.append({"name": wire.PD_KEY_ENV, "value": PD_KEY_FILE})
    return env


def _volumes(s: ServiceSpec) -> tuple[list[dict], list[dict], str]:
    vols, mounts = rc.scratch_volumes({"tmp": "/tmp", "cache": CACHE_DIR})
    mvols, mmounts, model_arg = rc.model_volume(s)
    avols, amounts = adapter_volumes(s)
    vols, mounts = vols + mvols + avols, mounts + mmounts + amounts
    kv = s.kvstore
    if kv is not None and kv.ssd_bytes:
        vols.append({"name": "kv-ssd", **_ssd_source(kv)})
        mounts.append({"name": "kv-ssd", "mountPath": SSD_MOUNT})
    shm = shm_size(s)
    if shm:
        # NCCL and torch's worker processes share memory through /dev/shm (64 MiB by default).
        vols.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if s.disaggregated:
        vols.append({"name": "pd-key", "secret": {"secretName": pd_secret_name(s),
                                                  "defaultMode": 0o440}})
        mounts.append({"name": "pd-key", "mountPath": PD_KEY_DIR, "readOnly": True})
    return vols, mounts, model_arg


def shm_size(s: ServiceSpec) -> str | None:
    return s.engine.shm_size or ("2Gi" if s.engine.device == "cuda" else None)


def _ssd_source(kv: KVStore) -> dict[str, Any]:
    """An emptyDir by default (Pod Security 'restricted' allows it, and the pod's fsGroup makes
    it writable); a generic ephemeral volume for a StorageClass; hostPath only when asked."""
    if kv.ssd_path:
        return {"hostPath": {"path": kv.ssd_path, "type": "DirectoryOrCreate"}}
    if kv.ssd_storage_class:
        return {"ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": kv.ssd_storage_class,
            "resources": {"requests": {"storage": str(kv.ssd_bytes)}}}}}}
    empty: dict[str, Any] = {"sizeLimit": str(kv.ssd_bytes)}
    if kv.ssd_medium:
        empty["medium"] = kv.ssd_medium
    return {"emptyDir": empty}


def _ssd_owner(s: ServiceSpec) -> dict[str, Any]:
    """A hostPath is created root:0755 and fsGroup does not apply to it: this init container
    (root, CHOWN and FOWNER only) hands the directory to the workers' uid at every start."""
    uid = wire.RUN_AS_USER
    return {"name": "kv-ssd-owner", "image": rc.worker_image(s),
            "imagePullPolicy": s.defaults.pull_policy,
            "command": ["sh", "-c", f"chown {uid}:{uid} {SSD_MOUNT} && chmod 0770 {SSD_MOUNT}"],
            "volumeMounts": [{"name": "kv-ssd", "mountPath": SSD_MOUNT}],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                          "limits": {"memory": "64Mi"}},
            "securityContext": {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
                                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
                                "seccompProfile": {"type": "RuntimeDefault"}}}


def worker_container(s: ServiceSpec, role: str) -> tuple[dict[str, Any], list[dict]]:
    vols, mounts, model_arg = _volumes(s)
    if s.engine.name == "vllm":
        command, args = ["vllm"], vllm_args(s, model_arg)
    else:
        command, args = ["kvyard"], kvyard_args(s, role, model_arg)
    ports = [{"name": "http", "containerPort": wire.WORKER_HTTP_PORT, "protocol": "TCP"}]
    if s.disaggregated and role in ("prefill", "both") and s.engine.name == "kvyard":
        ports.append({"name": "kv-peer", "containerPort": s.defaults.kv_peer_port,
                      "protocol": "TCP"})
    health = rc.http_probe("/health", "http", timeoutSeconds=5)
    container = {
        "name": "worker", "image": rc.worker_image(s), "imagePullPolicy": s.defaults.pull_policy,
        "command": command, "args": args, "env": _env(s), "ports": ports,
        "resources": s.engine.resources or _default_resources(s),
        "volumeMounts": mounts, "securityContext": rc.container_security(),
        # Loading a model (and compiling CPU kernels once) can take minutes: spec.engine's budget.
        "startupProbe": {**health, "periodSeconds": 5,
                         "failureThreshold": -(-s.engine.startup_seconds // 5)},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 6},
    }
    return container, vols


def pool_replicas(s: ServiceSpec, pool: Pool, keda: bool = True) -> int | None:
    """None when a KEDA ScaledObject owns the count (render_scaling.py). An autoscaled
    service without KEDA installed runs at `replicas`, at least 1: nothing would wake a
    pool at zero."""
    if not s.autoscaled:
        return pool.replicas
    return None if keda else max(1, pool.replicas)


def render_pool(s: ServiceSpec, pool: Pool, keda: bool = True) -> list[dict[str, Any]]:
    name = rc.name_of(s, "worker", pool.role)
    container, vols = worker_container(s, pool.role)
    pod: dict[str, Any] = {"containers": [container], "volumes": vols,
                           # In-flight generations get the worker's drain (--shutdown-timeout 30 s).
                           "terminationGracePeriodSeconds": 45}
    if s.engine.node_selector:
        pod["nodeSelector"] = dict(s.engine.node_selector)
    if s.engine.tolerations:
        pod["tolerations"] = [dict(t) for t in s.engine.tolerations]
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(wire.WORKER_HTTP_PORT),
                   "prometheus.io/path": "/metrics",
                   wire.KV_EVENTS_PORT_ANNOTATION: str(wire.WORKER_KV_EVENTS_PORT),
                   wire.KV_REPLAY_PORT_ANNOTATION: str(wire.WORKER_KV_REPLAY_PORT)}
    ports = [("http", wire.WORKER_HTTP_PORT)]
    if any(p["name"] == "kv-peer" for p in container["ports"]):
        ports.append(("kv-peer", s.defaults.kv_peer_port))
    return [rc.deployment(s, name, "worker", pool.role, pod, pool_replicas(s, pool, keda),
                          annotations),
            rc.service(s, name, "worker", pool.role, ports, headless=True)]


def _pool_extras(s: ServiceSpec, obj: dict[str, Any]) -> dict[str, Any]:
    """Placement, rollout, and the init steps (model download, SSD owner) of a pool."""
    if obj["kind"] != "Deployment":
        return obj
    pod = obj["spec"]["template"]["spec"]
    labels = obj["spec"]["selector"]["matchLabels"]
    pod["topologySpreadConstraints"] = rc.spread(s, "worker", labels.get(wire.ROLE_LABEL))
    if s.engine.affinity:
        pod["affinity"] = dict(s.engine.affinity)
    if s.engine.priority_class:
        pod["priorityClassName"] = s.engine.priority_class
    inits = [c for c in (rc.model_download(s),) if c is not None]
    if s.kvstore is not None and s.kvstore.ssd_bytes and s.kvstore.ssd_path:
        inits.append(_ssd_owner(s))
    if inits:
        pod["initContainers"] = inits
    if s.engine.device == "cuda":
        # No spare GPU for a surge pod: replace one at a time instead of waiting for one forever.
        obj["spec"]["strategy"] = {"type": "RollingUpdate",
                                   "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return obj


def render_pool_placed(s: ServiceSpec, pool: Pool, keda: bool = True) -> list[dict[str, Any]]:
    """One pool's Deployment and Service with its placement, rollout and init steps."""
    return [_pool_extras(s, obj) for obj in render_pool(s, pool, keda)]


def render_workers(s: ServiceSpec, keda: bool = True) -> list[dict[str, Any]]:
    return [obj for pool in s.pools for obj in render_pool_placed(s, pool, keda)]
