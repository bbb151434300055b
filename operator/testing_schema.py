"""What the API server does to an object's fields before it stores it (for testing.py).

Pruning: a real API server drops the fields a kind's schema does not declare. For the
built-in kinds the schemas are kubernetes-validate's (the API's own OpenAPI, with
`additionalProperties: false` where the API closes an object); for kvyard's
InferenceService it is the CRD's structural schema (operator/schema.py), status
included, honouring `x-kubernetes-preserve-unknown-fields`; metadata is ObjectMeta.
Kinds with no schema here (KEDA's ScaledObject, GAIE's InferencePool) are kept whole.

Defaulting: the Deployment's spec-level defaults (replicas 1, a RollingUpdate strategy
of 25 %/25 %, revisionHistoryLimit 10, progressDeadlineSeconds 600). Pod-template
defaults (restartPolicy, dnsPolicy, terminationMessagePath, ...) and other kinds'
defaults (a Service's clusterIP and type) are not applied; nor are the CRD schema's
`default`s.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
from kubernetes_validate import utils as kv_utils

from kvyard.common import wire

from .schema import OPENAPI_SCHEMA

_FILES = {"Deployment": "deployment-apps-v1", "Service": "service-v1",
          "ConfigMap": "configmap-v1", "Secret": "secret-v1",
          "ServiceAccount": "serviceaccount-v1", "Role": "role-rbac-v1",
          "RoleBinding": "rolebinding-rbac-v1", "Pod": "pod-v1"}
_OBJECT_META = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
# Written by the server itself; never pruned (FieldsV1 is an open map in the schema).
_SERVER_META = ("managedFields",)

DEPLOYMENT_DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "strategy": {"type": "RollingUpdate",
                 "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}},
    "revisionHistoryLimit": 10,
    "progressDeadlineSeconds": 600,
}


def _schema_dir() -> Path:
    version = kv_utils.latest_version()
    return Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / \
        f"v{version}-local-strict"


@functools.lru_cache(maxsize=1)
def _defs() -> dict[str, Any]:
    doc = json.loads((_schema_dir() / "_definitions.json").read_text())
    return doc.get("$defs") or doc["definitions"]   # the key older releases used


@functools.lru_cache(maxsize=None)
def _builtin(kind: str) -> dict[str, Any] | None:
    name = _FILES.get(kind)
    if name is None:
        return None
    return json.loads((_schema_dir() / f"{name}.json").read_text())


def schema_for(kind: str) -> tuple[dict[str, Any], bool] | None:
    """(schema, structural) for a kind, or None (kept whole). `structural`: a CRD's
    schema, where an object that declares nothing keeps nothing."""
    if kind == wire.CRD_KIND:
        return {**OPENAPI_SCHEMA, "properties": {**OPENAPI_SCHEMA["properties"],
                                                 "metadata": _OBJECT_META}}, True
    schema = _builtin(kind)
    return None if schema is None else (schema, False)


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while True:
        ref = schema.get("$ref")
        if ref is None and len(schema.get("allOf") or []) == 1:
            ref = schema["allOf"][0].get("$ref")
        if ref is None:
            return schema
        schema = _defs()[ref.rpartition("/")[2]]


def _prune(value: Any, schema: dict[str, Any], structural: bool) -> Any:
    schema = _resolve(schema)
    if isinstance(value, list):
        items = schema.get("items")
        return [_prune(v, items, structural) for v in value] if isinstance(items, dict) \
            else value
    if not isinstance(value, dict):
        return value
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    # A CRD's schema keeps only what it declares; the built-in schemas close an object
    # with `additionalProperties: false`.
    keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields")) or extra is True \
        or (not structural and extra is not False)
    out = {}
    for k, v in value.items():
        if k in props:
            out[k] = v if k in _SERVER_META else _prune(v, props[k], structural)
        elif isinstance(extra, dict):
            out[k] = _prune(v, extra, structural)
        elif keep_unknown:
            out[k] = v
    return out


def prune(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server would store it: undeclared fields dropped."""
    found = schema_for(obj.get("kind", ""))
    if found is None:
        return obj
    return _prune(obj, *found)


def default(obj: dict[str, Any]) -> dict[str, Any]:
    """Fill in the server-side defaults of the kinds listed in the module docstring."""
    if obj.get("kind") != "Deployment":
        return obj
    spec = obj.setdefault("spec", {})
    for k, v in DEPLOYMENT_DEFAULTS.items():
        if k not in spec:
            spec[k] = copy.deepcopy(v)
    strategy = spec["strategy"]
    if strategy.get("type") == "RollingUpdate" and "rollingUpdate" not in strategy:
        strategy["rollingUpdate"] = copy.deepcopy(DEPLOYMENT_DEFAULTS["strategy"]["rollingUpdate"])
    return obj


def without_defaults(live: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any]:
    """The live object less the defaulted fields `sent` (what the client wrote) left out
    and that hold exactly their default: what a test compares the two by."""
    if live.get("kind") != "Deployment":
        return live
    given = sent.get("spec") or {}
    spec = {k: v for k, v in (live.get("spec") or {}).items()
            if k in given or DEPLOYMENT_DEFAULTS.get(k, object()) != v}
    return {**live, "spec": spec}
