"""Shared helpers for the chart tests (test modules cannot import conftest): charts/kvyard
through Helm's own Go SDK (PyPI helm-python-sdk: libhelm_c over Helm v4), never a
re-implementation of its templates. The presets and their renders (cached), the CRD's schema,
a NetworkPolicy evaluator with Kubernetes semantics and the operator's children for a preset,
reached through the `ch` fixture at the end.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import helm_python as helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvyard"
CRD_DIR = CHART / "crds"
EXAMPLES = CHART / "examples"
NAMESPACE = "llm"
RELEASE = "kvyard"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": yaml.safe_load((CHART / "values-cpu.yaml").read_text()),
    "gpu": yaml.safe_load((CHART / "values-gpu.yaml").read_text()),
}
# Every optional part at once: PodMonitors, named namespaces, extra services, peers.
PRESETS["everything"] = {
    **copy.deepcopy(PRESETS["cpu"]),
    "operator": {"watchNamespaces": ["llm", "team-b"]},
    "networkPolicy": {"services": ["other"],
                      "metricsFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "monitoring"}}}],
                      "gatewayFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "ingress"}}}],
                      "eppFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "istio-system"}}}]},
    "metrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "keda": {"namespace": "autoscaling"},
}
# A gateway of the user's own (Istio's, in istio-system) routing through the InferencePool.
PRESETS["pool-gateway"] = {
    **copy.deepcopy(PRESETS["cpu"]),
    "networkPolicy": {"poolGatewayFrom": [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}},
        "podSelector": {"matchLabels": {"istio.io/gateway-name": "inference"}}}]},
}
PRESETS["external-redis"] = {
    **copy.deepcopy(PRESETS["cpu"]),
    "redis": {"enabled": False, "external": {"url": "redis://cache.infra:6379",
                                             "secretName": "cache-auth", "secretKey": "pw"}},
}


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(str(CHART))


@functools.cache
def _render(preset: str) -> tuple[tuple[str, str], ...]:
    out = chart().render(copy.deepcopy(PRESETS[preset]), name=RELEASE, namespace=NAMESPACE,
                         is_install=True)
    return tuple(sorted(out.items()))


def objects(preset: str) -> list[dict[str, Any]]:
    docs = []
    for path, text in _render(preset):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template"] = path
                docs.append(doc)
    return copy.deepcopy(docs)


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str) -> dict:
    [o] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


def crd_files() -> list[Path]:
    return sorted(CRD_DIR.glob("*.yaml")) if CRD_DIR.is_dir() else []


def crd_schema() -> dict[str, Any]:
    [path] = [p for p in crd_files() if p.name == "inferenceservices.kvyard.io.yaml"]
    crd = yaml.safe_load(path.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: the API server prunes them silently, so a
    misspelt field in an example would otherwise just be lost config."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_inference_service(obj: dict[str, Any]) -> None:
    body = {k: v for k, v in obj.items() if not k.startswith("__")}
    schema = _closed(crd_schema())
    jsonschema.validate(body, schema, cls=jsonschema.Draft7Validator)
    assert body["apiVersion"] == "kvyard.io/v1alpha1" and body["kind"] == "InferenceService"
    try:  # the CEL rules, as the operator re-checks them (jsonschema cannot run CEL)
        from kvyard.operator import spec as op_spec
    except ImportError:
        return
    meta = {"name": body["metadata"]["name"], "namespace": body["metadata"].get("namespace", "x"),
            "uid": "00000000-0000-0000-0000-000000000000", "generation": 1}
    op_spec.parse({**body, "metadata": meta})


def _needs_crd() -> None:
    if not crd_files():
        pytest.skip("charts/kvyard/crds/ is still empty (the operator's CRD is not written yet)")


def _selects(selector: dict | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        val, op = labels.get(e["key"]), e["operator"]
        if op == "In" and val not in e["values"]:
            return False
        if op == "NotIn" and val in e["values"]:
            return False
        if op == "Exists" and val is None:
            return False
        if op == "DoesNotExist" and val is not None:
            return False
    return True


def _peer_ok(peers: list[dict] | None, src: dict[str, str], src_ns: str, ns: str) -> bool:
    if peers is None:  # no `from`: everyone
        return True
    for p in peers:
        if "ipBlock" in p:
            continue  # pods are not matched by address here
        pod_ok = "podSelector" not in p or _selects(p["podSelector"], src)
        if "namespaceSelector" in p:
            ns_ok = _selects(p["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
        else:
            ns_ok = src_ns == ns
        if pod_ok and ns_ok:
            return True
    return False


def _ports_ok(ports: list[dict] | None, port: int) -> bool:
    return ports is None or any(p.get("port") == port for p in ports)


def ingress_allowed(policies, src: dict[str, str], dst: dict[str, str], port: int,
                    src_ns: str = NAMESPACE) -> bool:
    """Kubernetes semantics: a pod no Ingress policy selects takes everything; a selected pod
    takes the union of its policies' rules."""
    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]
                 and _selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    return any(_peer_ok(rule.get("from"), src, src_ns, NAMESPACE) and
               _ports_ok(rule.get("ports"), port)
               for p in selecting for rule in p["spec"].get("ingress") or [])


def _pod(service: str, component: str, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/managed-by": "kvyard-operator", "kvyard.io/service": service,
              "kvyard.io/component": component, "app.kubernetes.io/name": "kvyard",
              "app.kubernetes.io/instance": service}
    if role:
        labels["kvyard.io/role"] = role
    return labels


def _children(preset: str) -> list[dict]:
    """The operator's children for the chart's first InferenceService, rendered by the
    operator's own pure renderers, as the cluster would get them."""
    try:
        from kvyard.operator import render, spec as op_spec
    except ImportError:
        pytest.skip("kvyard.operator is not importable")
    [isvc] = by_kind(objects(preset), "InferenceService")
    body = {k: v for k, v in isvc.items() if not k.startswith("__")}
    body["metadata"] = {**body["metadata"], "uid": "u-1", "generation": 1}
    return render.render_all(op_spec.parse(body))


def _pods(children: list[dict]) -> list[tuple[str, dict[str, str], dict[str, int]]]:
    """(deployment name, pod labels, {container port name: number}) per child Deployment."""
    out = []
    for d in by_kind(children, "Deployment"):
        tmpl = d["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in tmpl["spec"]["containers"]
                 for p in c.get("ports", [])}
        out.append((d["metadata"]["name"], tmpl["metadata"]["labels"], ports))
    return out


@pytest.fixture
def ch():
    """The helpers above, for test modules (which cannot import conftest)."""
    import types

    return types.SimpleNamespace(
        ROOT=ROOT, CHART=CHART, CRD_DIR=CRD_DIR, EXAMPLES=EXAMPLES, NAMESPACE=NAMESPACE,
        RELEASE=RELEASE, K8S_VERSIONS=K8S_VERSIONS, PRESETS=PRESETS, chart=chart,
        _render=_render, objects=objects, by_kind=by_kind, one=one, crd_files=crd_files,
        crd_schema=crd_schema, validate_inference_service=validate_inference_service,
        _needs_crd=_needs_crd, _selects=_selects, ingress_allowed=ingress_allowed, _pod=_pod,
        _children=_children, _pods=_pods)
