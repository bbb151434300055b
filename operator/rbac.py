"""Exactly the permissions the operator uses (the Helm chart writes its ClusterRole or
Role from `RULES`; operator/README.md explains each).

`create` on every applied kind: server-side apply of an object that does not exist
yet is a create. `pods` get/list/watch: Kubernetes lets the operator grant the
EPP's Role only permissions it holds itself. Secrets are `get` (does the Redis
password's Secret and key exist) and `create` (the P/D key, once); never list or
watch, never update.
"""
from __future__ import annotations

from typing import Any

from kvyard.common import wire

APPLIED = ["get", "list", "create", "patch", "delete"]

RULES: list[dict[str, Any]] = [
    {"apiGroups": [wire.K8S_GROUP], "resources": [wire.CRD_PLURAL],
     "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [wire.K8S_GROUP], "resources": [f"{wire.CRD_PLURAL}/status"],
     "verbs": ["get", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": APPLIED},
    {"apiGroups": [""], "resources": ["services", "configmaps", "serviceaccounts"],
     "verbs": APPLIED},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": APPLIED},
    {"apiGroups": [wire.INFERENCE_POOL_GROUP], "resources": ["inferencepools"],
     "verbs": APPLIED},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    # kopf: events about the objects it handles, and its discovery of CRDs.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["list", "watch"]},
]
# Only with --all-namespaces or namespace patterns: kopf follows namespaces appearing.
NAMESPACE_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]


def cluster_role(name: str = "kvyard-operator", cluster_wide: bool = True) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name, "labels": {wire.MANAGED_BY_LABEL: "Helm"}},
            "rules": RULES + (NAMESPACE_RULES if cluster_wide else [])}
