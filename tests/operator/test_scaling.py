"""KEDA ScaledObjects: rendered exactly per pool (scale-to-zero on and off, autoscaling
off), the EPP's scaler port, the RBAC; and through the real handlers against the
emulated API: created, left alone while KEDA moves the replicas, updated, pruned,
deleted with the service, and a clear Degraded condition without KEDA's CRD."""
from __future__ import annotations

import pytest

from kvyard.cli import build_parser
from kvyard.common import wire
from kvyard.operator import rbac
from kvyard.operator.handover import applies_field
from kvyard.operator.render import render_all
from kvyard.operator.spec import parse

UID = "0b6f3a52-1c1e-4a57-9d7e-5f1c2d3e4f50"
CRS = "/apis/kvyard.io/v1alpha1/namespaces/default/inferenceservices"
DEPS = "/apis/apps/v1/namespaces/default/deployments"
STZ = {"scaleToZero": {"enabled": True, "idleSeconds": 120},
       "pools": {"prefill": {"minReplicas": 0, "maxReplicas": 2},
                 "decode": {"minReplicas": 1, "maxReplicas": 4}}}


def svc(spec: dict, ns: str = "team-a") -> object:
    return parse({"metadata": {"name": "demo", "namespace": ns, "uid": UID, "generation": 1},
                  "spec": spec})


def by_kind(children: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in children if o["kind"] == kind}


def expected(role: str, lo: int, hi: int, cooldown: int, ns: str = "team-a",
             uid: str = UID) -> dict:
    name = f"demo-{role}"
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {
            "name": name, "namespace": ns,
            "labels": {"app.kubernetes.io/managed-by": "kvyard-operator",
                       "app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": "demo",
                       "app.kubernetes.io/component": f"worker-{role}",
                       "kvyard.io/service": "demo", "kvyard.io/component": "worker",
                       "kvyard.io/role": role},
            "ownerReferences": [{"apiVersion": "kvyard.io/v1alpha1", "kind": "InferenceService",
                                 "name": "demo", "uid": uid, "controller": True,
                                 "blockOwnerDeletion": True}]},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "pollingInterval": 10, "cooldownPeriod": cooldown,
            "minReplicaCount": lo, "maxReplicaCount": hi,
            "triggers": [{"type": "external-push", "metadata": {
                "scalerAddress": f"demo-epp.{ns}.svc.cluster.local:9004",
                "pool": "demo", "role": role}}]}}


# --- render (pure) -----------------------------------------------------------------------

def test_scale_to_zero_renders_one_scaled_object_per_pool_exactly() -> None:
    children = render_all(svc(STZ))
    assert by_kind(children, "ScaledObject") == {
        "demo-prefill": expected("prefill", 0, 2, 120),
        "demo-decode": expected("decode", 0, 4, 120)}
    deps = by_kind(children, "Deployment")
    assert "replicas" not in deps["demo-prefill"]["spec"]
    assert "replicas" not in deps["demo-decode"]["spec"]
    assert deps["demo-epp"]["spec"]["replicas"] == 1
    # After every Deployment it scales (the order children are applied in).
    kinds = [o["kind"] for o in children]
    assert kinds.index("ScaledObject") > max(i for i, k in enumerate(kinds) if k == "Deployment")


def test_autoscaling_without_scale_to_zero_keeps_the_pools_minimum() -> None:
    spec = {"autoscaling": {"enabled": True},
            "pools": {"both": {"minReplicas": 2, "maxReplicas": 5, "replicas": 3}}}
    children = render_all(svc(spec))
    assert by_kind(children, "ScaledObject") == {"demo-both": expected("both", 2, 5, 300)}
    assert "replicas" not in by_kind(children, "Deployment")["demo-both"]["spec"]


def test_the_slo_is_passed_to_the_scaler() -> None:
    children = render_all(svc({**STZ, "slo": {"ttftMs": 800, "tpotMs": 40}}))
    for role in ("prefill", "decode"):
        so = by_kind(children, "ScaledObject")[f"demo-{role}"]
        assert so["spec"]["triggers"] == [{"type": "external-push", "metadata": {
            "scalerAddress": "demo-epp.team-a.svc.cluster.local:9004", "pool": "demo",
            "role": role, "ttftMs": "800", "tpotMs": "40"}}]


def test_no_autoscaling_no_scaled_objects_and_fixed_replicas() -> None:
    children = render_all(svc({"pools": {"both": {"minReplicas": 1, "maxReplicas": 5,
                                                  "replicas": 3}}}))
    assert by_kind(children, "ScaledObject") == {}
    assert by_kind(children, "Deployment")["demo-both"]["spec"]["replicas"] == 3


def test_without_keda_pools_run_at_fixed_replicas_at_least_one() -> None:
    children = render_all(svc(STZ), keda=False)
    assert by_kind(children, "ScaledObject") == {}
    deps = by_kind(children, "Deployment")
    assert deps["demo-prefill"]["spec"]["replicas"] == 1   # replicas 0 would never wake
    assert deps["demo-decode"]["spec"]["replicas"] == 1


def test_the_epp_serves_the_scaler_port() -> None:
    children = render_all(svc(STZ))
    epp = by_kind(children, "Deployment")["demo-epp"]
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    assert {"name": "scaler", "containerPort": 9004, "protocol": "TCP"} in c["ports"]
    a = build_parser(c["args"]).parse_args(c["args"])  # the real `kvyard epp` parser
    assert (a.scaler_port, a.pool_name) == (9004, "demo")  # = scalerMetadata.pool
    ports = {p["name"]: p for p in by_kind(children, "Service")["demo-epp"]["spec"]["ports"]}
    assert ports["scaler"] == {"name": "scaler", "port": 9004, "targetPort": "scaler",
                               "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}


def test_rbac_for_scaled_objects_is_exactly_what_the_operator_calls() -> None:
    granted = {(g, r): set(rule["verbs"]) for rule in rbac.RULES
               for g in rule["apiGroups"] for r in rule["resources"]}
    # apply = create + patch; the KEDA check and prune = list; prune = delete.
    assert granted[("keda.sh", "scaledobjects")] == {"list", "create", "patch", "delete"}
    assert not [k for k in granted if k[0] == "keda.sh" and k[1] != "scaledobjects"]


# --- the operator against the emulated API -----------------------------------------------

def status(kube, kind: str) -> tuple[str, str]:
    c = kube.condition(kind)
    return c.get("status", ""), c.get("reason", "")


def content(obj: dict) -> dict:
    md = {k: v for k, v in obj["metadata"].items()
          if k not in ("uid", "resourceVersion", "generation", "creationTimestamp",
                       "managedFields")}
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": md}


def scaled_objects(kube) -> dict[str, dict]:
    return {name: o for (kind, name), o in kube.children().items() if kind == "ScaledObject"}


async def test_scaled_objects_follow_create_update_and_delete(kube, operator, wait_for) -> None:
    spec = {"scaleToZero": {"enabled": True, "idleSeconds": 60},
            "pools": {"both": {"minReplicas": 0, "maxReplicas": 3}}}
    async with operator(resync_s=0.3):
        uid = (await kube.create("demo", spec))["metadata"]["uid"]
        await wait_for(lambda: "demo-both" in scaled_objects(kube), what="ScaledObject")
        assert content(scaled_objects(kube)["demo-both"]) == \
            expected("both", 0, 3, 60, ns="default", uid=uid)
        # The operator's apply never sets the count (the API server defaults it to 1).
        assert not applies_field(kube.children()[("Deployment", "demo-both")],
                                 wire.FIELD_MANAGER, ("spec", "replicas"))

        # KEDA takes the pool to zero (its HPA writes the Deployment's replicas): the
        # operator's passes leave the count alone, and status says scaled to zero, Ready.
        await kube.patch(f"{DEPS}/demo-both", {"spec": {"replicas": 0}})
        await kube.api.settle()
        await wait_for(lambda: status(kube, "Ready") == ("True", "ScaledToZero"),
                       what="Ready at zero")
        await kube.delete("/api/v1/namespaces/default/services/demo-epp")  # drift: one more pass
        await wait_for(lambda: ("Service", "demo-epp") in kube.children(), what="a later pass")
        assert kube.children()[("Deployment", "demo-both")]["spec"]["replicas"] == 0
        # ... and KEDA scaling it back up is left alone too.
        await kube.patch(f"{DEPS}/demo-both", {"spec": {"replicas": 2}})
        await kube.api.settle()
        await wait_for(lambda: status(kube, "Ready") == ("True", "Serving"))
        assert kube.children()[("Deployment", "demo-both")]["spec"]["replicas"] == 2

        # Update: new bounds and idle time reach the ScaledObject.
        await kube.patch(f"{CRS}/demo", {"spec": {"scaleToZero": {"idleSeconds": 45},
                                                  "pools": {"both": {"maxReplicas": 6}}}})
        await wait_for(lambda: scaled_objects(kube)["demo-both"]["spec"]["maxReplicaCount"] == 6)
        assert content(scaled_objects(kube)["demo-both"]) == \
            expected("both", 0, 6, 45, ns="default", uid=uid)

        # Scale-to-zero off, autoscaling on: the pool's minimum.
        await kube.patch(f"{CRS}/demo", {"spec": {"autoscaling": {"enabled": True},
                                                  "scaleToZero": {"enabled": False},
                                                  "pools": {"both": {"minReplicas": 1}}}})
        await wait_for(lambda: scaled_objects(kube)["demo-both"]["spec"]["minReplicaCount"] == 1)
        assert content(scaled_objects(kube)["demo-both"]) == \
            expected("both", 1, 6, 45, ns="default", uid=uid)

        # Autoscaling off: the ScaledObject is pruned, the Deployment gets its count back.
        await kube.patch(f"{CRS}/demo", {"spec": {"autoscaling": {"enabled": False},
                                                  "pools": {"both": {"replicas": 4}}}})
        await wait_for(lambda: not scaled_objects(kube), what="ScaledObject pruned")
        await wait_for(lambda: kube.children()[("Deployment", "demo-both")]["spec"]
                       .get("replicas") == 4, what="fixed replicas")

        # Back on, then the service deleted: everything goes with it.
        await kube.patch(f"{CRS}/demo", {"spec": {"scaleToZero": {"enabled": True}}})
        await wait_for(lambda: "demo-both" in scaled_objects(kube))
        await kube.delete(f"{CRS}/demo")
        await wait_for(lambda: kube.cr() is None and not kube.children(), what="cleanup")
    assert kube.api.live("scaledobjects") == []


async def test_pd_pools_each_get_one(kube, operator, wait_for) -> None:
    async with operator():
        uid = (await kube.create("demo", STZ))["metadata"]["uid"]
        await wait_for(lambda: set(scaled_objects(kube)) == {"demo-prefill", "demo-decode"})
        assert {n: content(o) for n, o in scaled_objects(kube).items()} == {
            "demo-prefill": expected("prefill", 0, 2, 120, ns="default", uid=uid),
            "demo-decode": expected("decode", 0, 4, 120, ns="default", uid=uid)}
        # The prefill pool removed: its ScaledObject goes, the decode pool's stays.
        await kube.patch(f"{CRS}/demo", {"spec": {"pools": {"prefill": None}}})
        await wait_for(lambda: set(scaled_objects(kube)) == {"demo-decode"}, what="pruned")


@pytest.mark.no_keda_crd
async def test_without_keda_the_service_is_degraded_and_still_served(kube, operator,
                                                                       wait_for) -> None:
    async with operator():
        await kube.create("demo", {"scaleToZero": {"enabled": True},
                                   "pools": {"both": {"minReplicas": 0, "maxReplicas": 3}}})
        await wait_for(lambda: status(kube, "Degraded") == ("True", "KEDANotInstalled"))
        assert "keda.sh/v1alpha1" in kube.condition("Degraded")["message"]
        kids = kube.children()
        assert ("Deployment", "demo-epp") in kids and ("Deployment", "demo-gateway") in kids
        assert not [k for k in kids if k[0] == "ScaledObject"]
        assert kids[("Deployment", "demo-both")]["spec"]["replicas"] == 1
        await kube.api.settle()
        await wait_for(lambda: status(kube, "Ready") == ("True", "Serving"))
