"""Handing a Deployment's `spec.replicas` from the operator to KEDA's HPA without a gap.

When autoscaling is turned on, the operator's server-side apply stops sending a pool's
`spec.replicas` (render_workers.pool_replicas). Dropped from the applier's config, a
field no other manager owns is removed, and the API server defaults a Deployment's
replicas to 1: N-1 GPU pods killed before KEDA's HPA acts. Kubernetes' documented
handover ("Transferring ownership", server-side apply) closes the gap: first a second
field manager applies the live value alone, so it shares the field; then the operator's
apply may drop it. The HPA's next scale write takes the field from that manager. A
409 Conflict on the handover apply means another manager (the HPA) owns the field
already. Done only while the operator's own apply still owns the field, so once per
transition.
"""
from __future__ import annotations

from typing import Any

from kvyard.common import wire

from .client import ApiError, Client

HANDOVER_MANAGER = f"{wire.FIELD_MANAGER}-handover"
REPLICAS = ("spec", "replicas")


def applies_field(obj: dict[str, Any], manager: str, path: tuple[str, ...]) -> bool:
    """Does `manager` own `path` through server-side apply (metadata.managedFields)?"""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply" \
                or entry.get("subresource"):
            continue
        node: Any = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, dict) else None
        if isinstance(node, dict):
            return True
    return False


async def hand_over_replicas(api: Client, rendered: dict[str, Any]) -> bool:
    """Before applying a Deployment rendered without replicas: make the live count
    survive the operator letting go of it. True when a handover apply was made."""
    if rendered["kind"] != "Deployment" or "replicas" in rendered["spec"]:
        return False
    md = rendered["metadata"]
    live = await api.get("Deployment", md["namespace"], md["name"])
    if live is None or not applies_field(live, wire.FIELD_MANAGER, REPLICAS):
        return False
    replicas = (live.get("spec") or {}).get("replicas")
    if replicas is None:
        return False
    try:
        await api.apply({"apiVersion": rendered["apiVersion"], "kind": "Deployment",
                         "metadata": {"name": md["name"], "namespace": md["namespace"]},
                         "spec": {"replicas": replicas}}, manager=HANDOVER_MANAGER, force=False)
    except ApiError as e:
        if e.status != 409:  # 409: the HPA owns the field already
            raise
    return True
