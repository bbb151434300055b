"""Exactly the permissions the operator uses (the Helm chart writes its ClusterRole or
Role from `RULES`; operator/README.md explains each).

`create` on every applied kind: server-side apply of an object that does not exist
yet is a create. `pods` get/list/watch: the status reads the service's pods (why one
is not ready), and Kubernetes lets the operator grant the EPP's Role only permissions
it holds itself. Secrets are `get` (does the Redis
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
    # watch: the status follows the Deployments (handlers.py), not a polling loop.
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": APPLIED + ["watch"]},
    {"apiGroups": [""], "resources": ["services", "configmaps", "serviceaccounts"],
     "verbs": APPLIED},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": APPLIED},
    {"apiGroups": [wire.INFERENCE_POOL_GROUP], "resources": ["inferencepools"],
     "verbs": APPLIED},
    # KEDA ScaledObjects: applied (create + patch), listed (is KEDA installed? what to
    # prune), pruned. Never read one by name, never watched.
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"],
     "verbs": ["list", "create", "patch", "delete"]},
    # cert-manager Certificates for the EPPs' TLS (render_tls.py): applied, listed, pruned.
    {"apiGroups": ["cert-manager.io"], "resources": ["certificates"],
     "verbs": ["list", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    # kopf posts warnings about the objects it handles as Events. It watches no CRDs
    # or namespaces (scanning is off: handlers.configure), so it needs no rule for them.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]


def role(kind: str = "ClusterRole", name: str = "kvyard-operator") -> dict[str, Any]:
    """The rules as a ClusterRole (all namespaces) or a Role (one namespace)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind,
            "metadata": {"name": name}, "rules": RULES}
