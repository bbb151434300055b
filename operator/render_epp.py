"""The EPP: Deployment, Service (ext_proc, health, metrics, and the KEDA external scaler
KEDA's operator calls), ConfigMap (scheduler config from spec.routing), and
the ServiceAccount/Role/RoleBinding its pod discovery needs (pods: get/list/watch).

The scheduler config has the shape of epp/scheduler.example.yaml (one profile) or,
with a prefill pool, epp/scheduler.pd.example.yaml (decode first); a test loads the
rendered one with the EPP's own config loader. Its prefix scorer is precise-prefix-cache
(the workers' KV events, found through their pod annotations) wherever the EPP has the
workers' tokenizer, else prefix-cache.
"""
from __future__ import annotations

from typing import Any

import yaml

from kvyard.common import wire

from . import render_common as rc
from . import render_tls
from .models import EPP_READABLE, extra_model_volume, models_table
from .render_scaling import pool_name
from .render_workers import PD_KEY_DIR, PD_KEY_FILE, pd_secret_name
from .spec import ServiceSpec

CONFIG_DIR = f"{rc.CONFIG_MOUNT}/epp"
CONFIG_FILE = "scheduler.yaml"
MODELS_FILE = "models.yaml"  # several models / adapters (kvyard.epp.models)
# spec.epp.replicas > 1 (kvyard.epp.replicas): the pick pub/sub port and its snapshot
# port (the EPP's REPLICA_PORT and the next; the operator does not import the EPP).
REPLICA_PORT = 9005


def replicas_service(s: ServiceSpec) -> str:
    """The headless Service of the EPP pods: the replicas find each other through its DNS
    records, and the gateways list every replica from them (a STRICT_DNS cluster)."""
    return f"{rc.name_of(s, 'epp')}-replicas"


def _replica_args(s: ServiceSpec) -> list[str]:
    if s.epp_replicas <= 1:
        return []
    return ["--replica-port", str(REPLICA_PORT),
            "--peers-dns", f"{rc.service_host(s, replicas_service(s))}:{REPLICA_PORT}"]


def _replicas_svc(s: ServiceSpec) -> dict[str, Any]:
    """Not-ready pods included: a starting replica asks its peers for their picks before
    it is ready, and the gateways health-check each replica themselves."""
    svc = rc.service(s, replicas_service(s), "epp", None,
                     [("ext-proc", wire.EPP_EXT_PROC_PORT), ("health", wire.EPP_HEALTH_PORT),
                      ("picks", REPLICA_PORT), ("snapshots", REPLICA_PORT + 1)], headless=True)
    svc["spec"]["publishNotReadyAddresses"] = True
    return svc


def epp_block_size(worker_block: int) -> int:
    """A prompt block for the EPP's hashes covers whole worker blocks, about 64 tokens."""
    return worker_block * max(1, -(-64 // worker_block))


def precise_routing(s: ServiceSpec) -> bool:
    """Whether the EPP routes by the workers' KV events (the workers always publish them,
    render_workers.kv_events_args): only where it has their tokenizer to key a request
    as the engine does (epp_model_arg), for every model's pool (models.EPP_READABLE);
    else its approximate index alone."""
    return epp_model_arg(s, "") != "none" and all(m.model.source in EPP_READABLE for m in s.models)


def _scorers(s: ServiceSpec, kv_util: bool) -> list[dict[str, Any]]:
    r = s.routing
    prefix = "precise-prefix-cache" if precise_routing(s) else "prefix-cache"
    out = [{"type": prefix, "weight": r.prefix_cache, "lruCapacityPerServer": 31250},
           {"type": "queue", "weight": r.queue}]
    if kv_util:
        out.append({"type": "kv-cache-utilization", "weight": r.kv_cache_utilization})
    if s.adapters:
        out.append({"type": "lora-affinity", "weight": r.lora_affinity})
    return out


def scheduler_config(s: ServiceSpec) -> dict[str, Any]:
    # The waiting room holds requests through a wake from zero (epp/flow_control.py).
    base = {"blockSize": epp_block_size(s.engine.block_size),
            "flowControl": {"noEndpointRequestTTL": f"{s.cold_start_seconds}s"}}
    objectives = {"batch": -1, "interactive": 0}
    if not s.disaggregated:
        return {**base, "profileHandler": {"type": "single-profile"},
                "profiles": {"default": {
                    "filters": ["healthy", "prefer-fresh", "role"],
                    "scorers": _scorers(s, True),
                    "picker": {"type": "max-score", "maxEndpoints": 1}}},
                "objectives": objectives}
    return {**base,
            "profileHandler": {"type": "disagg-profile-handler", "decodeProfile": "decode",
                               "prefillProfile": "prefill",
                               "nonCachedTokens": s.routing.non_cached_tokens,
                               "promptTokens": s.routing.prompt_tokens},
            "profiles": {
                "decode": {"filters": ["healthy", "prefer-fresh", "role"],
                           "scorers": _scorers(s, True), "picker": {"type": "max-score"}},
                "prefill": {"filters": ["healthy", "prefer-fresh", "prefill-role"],
                            "scorers": _scorers(s, False), "picker": {"type": "max-score"}}},
            "objectives": objectives}


def epp_model_arg(s: ServiceSpec, model_arg: str) -> str:
    """The tokenizer source: the workers' model where the EPP pod can read it; a path
    inside a custom worker image is not in the EPP's image, and a download is the workers'
    own (the EPP does not fetch gigabytes for a tokenizer), so prompts hash as bytes."""
    return "none" if s.model.source in ("hf", "gguf", "download") else model_arg


def epp_args(s: ServiceSpec, model_arg: str) -> list[str]:
    selector = f"{wire.SERVICE_LABEL}={s.name},{wire.COMPONENT_LABEL}=worker"
    args = ["epp", "--host", "0.0.0.0", "--ext-proc-port", str(wire.EPP_EXT_PROC_PORT),
            "--health-port", str(wire.EPP_HEALTH_PORT),
            "--metrics-port", str(wire.EPP_METRICS_PORT),
            "--scaler-port", str(wire.EPP_SCALER_PORT), "--pool-name", pool_name(s),
            "--k8s-namespace", s.namespace, "--k8s-selector", selector,
            "--target-port", str(wire.WORKER_HTTP_PORT),
            "--model", epp_model_arg(s, model_arg),
            "--config", f"{CONFIG_DIR}/{CONFIG_FILE}",
            "--destination-fallbacks", str(s.routing.destination_fallbacks)]
    if s.model.served_name:
        args += ["--served-model-name", s.model.served_name]
    if models_table(s) is not None:
        args += ["--models-file", f"{CONFIG_DIR}/{MODELS_FILE}"]
    if s.disaggregated:
        args += ["--pd-key-file", PD_KEY_FILE]
    return args + _replica_args(s) + render_tls.epp_args(s)


def _rbac(s: ServiceSpec) -> list[dict[str, Any]]:
    name = rc.name_of(s, "epp")
    md = rc.metadata(s, name, "epp")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": md,
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": md,
         "rules": [{"apiGroups": [""], "resources": ["pods"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": md,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": s.namespace}]},
    ]


def render_epp(s: ServiceSpec) -> list[dict[str, Any]]:
    name = rc.name_of(s, "epp")
    text = yaml.safe_dump(scheduler_config(s), sort_keys=False)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": rc.metadata(s, name, "epp"),
          "data": {CONFIG_FILE: text}}
    table = models_table(s, tokenizers=precise_routing(s))
    if table is not None:
        cm["data"][MODELS_FILE] = yaml.safe_dump(table, sort_keys=False)
        text += cm["data"][MODELS_FILE]  # the config hash covers the models too
    vols, mounts = rc.scratch_volumes({"tmp": "/tmp"})
    mvols, mmounts, model_arg = rc.model_volume(s)
    if s.model.source == "download":
        mvols, mmounts = [], []
    vols += mvols + [{"name": "config", "configMap": {"name": name}}]
    mounts += mmounts + [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if precise_routing(s):   # the extra models' tokenizers (models.extra_model_volume)
        for m in s.models:
            xv, xm, _ = extra_model_volume(s, m)
            vols += xv
            mounts += xm
    if s.disaggregated:
        vols.append({"name": "pd-key", "secret": {"secretName": pd_secret_name(s),
                                                  "defaultMode": 0o440}})
        mounts.append({"name": "pd-key", "mountPath": PD_KEY_DIR, "readOnly": True})
    tvols, tmounts = render_tls.volume(s, gateway=False)
    vols += tvols
    mounts += tmounts
    grpc = {"grpc": {"port": wire.EPP_HEALTH_PORT}, "timeoutSeconds": 2}
    container = {
        "name": "epp", "image": rc.default_image(s), "imagePullPolicy": s.defaults.pull_policy,
        "command": ["kvyard"], "args": epp_args(s, model_arg),
        "env": [{"name": "HOME", "value": "/tmp"},
                {"name": "NAMESPACE", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": "ext-proc", "containerPort": wire.EPP_EXT_PROC_PORT, "protocol": "TCP"},
                  {"name": "health", "containerPort": wire.EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": wire.EPP_METRICS_PORT, "protocol": "TCP"},
                  {"name": "scaler", "containerPort": wire.EPP_SCALER_PORT, "protocol": "TCP"},
                  *([{"name": "picks", "containerPort": REPLICA_PORT, "protocol": "TCP"},
                     {"name": "snapshots", "containerPort": REPLICA_PORT + 1, "protocol": "TCP"}]
                    if s.epp_replicas > 1 else [])],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                      "limits": {"memory": "2Gi"}},
        "volumeMounts": mounts, "securityContext": rc.container_security(),
        "startupProbe": {**grpc, "periodSeconds": 2, "failureThreshold": 60},
        "readinessProbe": {**grpc, "periodSeconds": 5},
        "livenessProbe": {**grpc, "periodSeconds": 10, "failureThreshold": 3},
    }
    pod = {"serviceAccountName": name, "containers": [container], "volumes": vols}
    if s.epp_replicas > 1:
        pod["topologySpreadConstraints"] = rc.spread(s, "epp")
    # A scheduler change must restart the EPP (it reads its config once).
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(wire.EPP_METRICS_PORT),
                   "kvyard.io/config-hash": rc.digest(text)}
    svc = rc.service(s, name, "epp", None, [("ext-proc", wire.EPP_EXT_PROC_PORT),
                                            ("health", wire.EPP_HEALTH_PORT),
                                            ("metrics", wire.EPP_METRICS_PORT),
                                            ("scaler", wire.EPP_SCALER_PORT)])
    if render_tls.epp_tls(s) is not None:  # TLS, no longer cleartext HTTP/2 (h2c)
        for port in svc["spec"]["ports"]:
            port.pop("appProtocol", None)
    cert = render_tls.certificate(s)
    extra = [_replicas_svc(s)] if s.epp_replicas > 1 else []
    return [*_rbac(s), cm, *([cert] if cert else []),
            rc.deployment(s, name, "epp", None, pod, s.epp_replicas, annotations), svc, *extra]

