"""One KEDA ScaledObject per worker pool, fed by the EPP's external scaler (pure).

Rendered when the service autoscales (`spec.autoscaling.enabled` or
`spec.scaleToZero.enabled`). The trigger is `external-push`: KEDA holds a
`StreamIsActive` stream open to the EPP's scaler port, so a request that reaches
a pool at zero wakes it at once instead of at the next poll; scaling down, and
between 1 and N, goes through the polling loop (`IsActive`, `GetMetrics`) and
the HPA KEDA creates. `scalerMetadata` is the trigger's `metadata`: `pool` (the
EPP's pool: the service's name, its `--pool-name`) and `role` (the pool's
role), which tell the EPP which demand to report, plus `ttftMs`/`tpotMs` from
`spec.slo`, the objectives the EPP sizes a replica at.

Not fighting KEDA: a pool with a ScaledObject is rendered without
`spec.replicas` (render_workers.pool_replicas), so the operator's server-side
apply does not own that field and KEDA's HPA writes it alone (when autoscaling is
turned on, handover.py hands the live count over first, so the API server's
default of 1 never applies in between); the operator never
reads a pool's desired count back into a Deployment, and it never touches the
HPA KEDA owns. Without KEDA installed (`keda=False`: the reconcile pass found no
ScaledObject API) the pools run at fixed replicas and status says why.
"""
from __future__ import annotations

from typing import Any

from kvyard.common import wire

from . import render_common as rc
from . import render_tls
from .spec import Pool, ServiceSpec

KEDA_API = "keda.sh/v1alpha1"
TRIGGER = "external-push"
# KEDA's own default is 30 s. The poll decides the step to zero (after cooldownPeriod)
# and when to hand 1..N to the HPA; waking from zero does not wait for it (the push).
POLLING_S = 10


def pool_name(s: ServiceSpec) -> str:
    """The EPP's pool, as `scalerMetadata.pool` names it: the service (= its InferencePool)."""
    return s.name


def scaler_address(s: ServiceSpec) -> str:
    return f"{rc.service_host(s, rc.name_of(s, 'epp'))}:{wire.EPP_SCALER_PORT}"


def min_replicas(s: ServiceSpec, pool: Pool) -> int:
    return 0 if s.scale_to_zero else pool.min_replicas


def trigger_metadata(s: ServiceSpec, pool: Pool) -> dict[str, str]:
    """`scalerMetadata` (strings, as KEDA passes them); spec.slo becomes the objectives the
    EPP measures a replica's capacity at (epp/scaler_meta.py's keys)."""
    meta = {"scalerAddress": scaler_address(s), "pool": pool_name(s), "role": pool.role}
    for key in ("ttftMs", "tpotMs"):
        if s.slo.get(key):
            meta[key] = str(s.slo[key])
    return meta


def trigger(s: ServiceSpec, pool: Pool) -> dict[str, Any]:
    """With TLS on the EPP, KEDA reads the CA (and its client certificate) through the
    chart's (Cluster)TriggerAuthentication (render_tls.py)."""
    out: dict[str, Any] = {"type": TRIGGER, "metadata": trigger_metadata(s, pool)}
    auth = render_tls.authentication_ref(s)
    if auth:
        out["authenticationRef"] = auth
    return out


def scaled_object(s: ServiceSpec, pool: Pool) -> dict[str, Any]:
    name = rc.name_of(s, "worker", pool.role)
    return {"apiVersion": KEDA_API, "kind": "ScaledObject",
            "metadata": rc.metadata(s, name, "worker", pool.role),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                   "name": name},
                "pollingInterval": POLLING_S,
                "cooldownPeriod": s.idle_seconds,
                "minReplicaCount": min_replicas(s, pool),
                "maxReplicaCount": pool.max_replicas,
                "triggers": [trigger(s, pool)],
            }}


def render_scaling(s: ServiceSpec, keda: bool = True) -> list[dict[str, Any]]:
    if not (s.autoscaled and keda):
        return []
    return [scaled_object(s, pool) for pool in s.pools]
