"""spec -> the complete list of child manifests, in apply order (pure).

Order: the EPP's RBAC and config before its Deployment, workers before the EPP
that discovers them, the gateway, then the ScaledObjects (their scaler, the EPP,
exists by then). The P/D key Secret is the one child that
is not pure (a random key, created once): `pd_key_secret` renders it for a key.
"""
from __future__ import annotations

import base64
from typing import Any

from kvyard.common import wire

from . import render_common as rc
from .models import PRIMARY_POOL, label_primary, render_model_pools
from .render_epp import render_epp
from .render_gateway import render_gateway
from .render_scaling import render_scaling
from .render_workers import pd_secret_name, render_pool_placed, render_workers
from .spec import ServiceSpec

POOL_API = f"{wire.INFERENCE_POOL_GROUP}/{wire.INFERENCE_POOL_VERSION}"


def inference_pool(s: ServiceSpec) -> dict[str, Any]:
    """GAIE v1: the workers (selector + port) and the EPP that picks among them, so a
    Gateway API implementation (Istio, kgateway, GKE) can route through kvyard's EPP."""
    return {"apiVersion": POOL_API, "kind": "InferencePool",
            "metadata": rc.metadata(s, s.name, "epp"),
            "spec": {"selector": {"matchLabels": rc.selector_labels(s, "worker")},
                     "targetPorts": [{"number": wire.WORKER_HTTP_PORT}],
                     "appProtocol": "http",
                     "endpointPickerRef": {"group": "", "kind": "Service",
                                           "name": rc.name_of(s, "epp"),
                                           "port": {"number": wire.EPP_EXT_PROC_PORT},
                                           "failureMode": "FailClose"}}}


def model_inference_pools(s: ServiceSpec) -> list[dict[str, Any]]:
    """With several models, one InferencePool per base model (as GAIE and llm-d run them),
    each selecting its pool's pods, all picked by the one EPP."""
    out = []
    for pool in [PRIMARY_POOL, *(m.name for m in s.models)]:
        ip = inference_pool(s)
        ip["metadata"]["name"] = f"{s.name}-{pool}"
        ip["metadata"]["labels"][wire.POOL_LABEL] = pool
        ip["spec"]["selector"]["matchLabels"] = {
            wire.SERVICE_LABEL: s.name, wire.COMPONENT_LABEL: "worker", wire.POOL_LABEL: pool}
        out.append(ip)
    return out


def pd_key_secret(s: ServiceSpec, key_hex: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": rc.metadata(s, pd_secret_name(s), "epp"),
            "data": {"key": base64.b64encode((key_hex + "\n").encode()).decode()}}


def render_all(s: ServiceSpec, keda: bool = True) -> list[dict[str, Any]]:
    """`keda`: the cluster serves KEDA's ScaledObject API (the pass checks); without it an
    autoscaled service's pools get fixed replicas and no ScaledObjects."""
    children = label_primary(s, render_workers(s, keda)) + render_model_pools(
        s, render_pool_placed, keda)
    children += render_epp(s) + render_gateway(s)
    if s.inference_pool:
        children += model_inference_pools(s) if s.models else [inference_pool(s)]
    return children + render_scaling(s, keda)


def gateway_address(s: ServiceSpec) -> str:
    return f"{rc.name_of(s, 'gateway')}.{s.namespace}.svc:{wire.GATEWAY_HTTP_PORT}"
