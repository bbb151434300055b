"""Faults a real API server shows and a lenient fake hid, and the emulator's fidelity for
them (kvyard.operator.testing): field pruning, Deployment defaults, server-side apply
ownership and conflicts, subresources; then the operator through them: turning
autoscaling on hands spec.replicas to KEDA's HPA without the API server's default of 1
in between."""
from __future__ import annotations

import aiohttp

from kvyard.common import wire
from kvyard.operator.handover import HANDOVER_MANAGER, REPLICAS, applies_field

from .conftest import CRS, DEPLOYMENTS

CPU = {"model": {"source": "demo"}}


def dep_body(replicas: int | None = None, **extra: object) -> dict:
    labels = {"app": "x"}
    spec: dict = {"selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels},
                               "spec": {"containers": [{"name": "c", "image": "i"}]}}, **extra}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "x", "namespace": "default"}, "spec": spec}


async def apply(kube, body: dict, manager: str, force: bool = False) -> tuple[int, dict]:
    url = f"{str(kube.api.url).rstrip('/')}{DEPLOYMENTS}/x" \
        f"?fieldManager={manager}&force={'true' if force else 'false'}"
    async with aiohttp.ClientSession() as session, session.patch(
            url, json=body, headers={"Content-Type": "application/apply-patch+yaml"}) as r:
        return r.status, await r.json()


def owners(obj: dict, path: tuple[str, ...]) -> set[str]:
    out = set()
    for e in obj["metadata"].get("managedFields") or []:
        node = e["fieldsV1"]
        for k in path:
            node = node.get(f"f:{k}") if isinstance(node, dict) else None
        if isinstance(node, dict):
            out.add(e["manager"])
    return out


# --- the emulated API server ----------------------------------------------------------------

async def test_deployment_defaults_and_pruning(kube) -> None:
    status, got = await apply(kube, dep_body(bogus=1), "me")
    assert status in (200, 201), got
    live = kube.api.get_live("deployments", "default", "x")
    assert "bogus" not in live["spec"]
    assert live["spec"]["replicas"] == 1
    assert live["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxUnavailable": "25%", "maxSurge": "25%"}}
    assert live["spec"]["progressDeadlineSeconds"] == 600
    assert owners(live, REPLICAS) == set()  # a default belongs to nobody


async def test_apply_conflicts_force_and_dropped_fields(kube) -> None:
    await apply(kube, dep_body(3), "operator", force=True)
    # Another manager's different value: 409 naming the field; the same value is shared.
    status, got = await apply(kube, dep_body(5), "other")
    assert status == 409 and ".spec.replicas" in got["message"] and "operator" in got["message"]
    status, _ = await apply(kube, {**dep_body(3), "spec": {"replicas": 3}}, "other")
    assert status == 200
    live = kube.api.get_live("deployments", "default", "x")
    assert owners(live, REPLICAS) == {"operator", "other"}
    # The operator drops the field: the other manager keeps the value.
    await apply(kube, dep_body(), "operator", force=True)
    live = kube.api.get_live("deployments", "default", "x")
    assert live["spec"]["replicas"] == 3 and owners(live, REPLICAS) == {"other"}
    # A scale write (the HPA) takes the field without a conflict.
    await kube.scale("x", 4)
    live = kube.api.get_live("deployments", "default", "x")
    assert live["spec"]["replicas"] == 4 and owners(live, REPLICAS) == {"kube-controller-manager"}
    # Forced, the operator takes it back; then dropping it leaves the default.
    await apply(kube, dep_body(2), "operator", force=True)
    assert owners(kube.api.get_live("deployments", "default", "x"), REPLICAS) == {"operator"}
    await apply(kube, dep_body(), "operator", force=True)
    assert kube.api.get_live("deployments", "default", "x")["spec"]["replicas"] == 1


async def test_status_subresource_and_status_pruning(kube) -> None:
    cr = await kube.create("demo", CPU)
    assert "status" not in cr
    await kube.patch(f"{CRS}/demo", {"status": {"observedGeneration": 5}})  # main: ignored
    assert "status" not in (kube.cr() or {})
    await kube.patch(f"{CRS}/demo/status", {"spec": {"model": {"source": "x"}},
                                            "status": {"observedGeneration": 1,
                                                       "reconcile-create": {"done": True},
                                                       "pools": {"both": {"replicas": 1,
                                                                          "extra": 2}}}})
    live = kube.cr()
    assert live["spec"]["model"]["source"] == "demo"        # status write: status only
    assert live["status"] == {"observedGeneration": 1, "pools": {"both": {"replicas": 1}}}
    assert live["metadata"]["generation"] == 1


# --- the operator through it --------------------------------------------------------------------

async def test_turning_autoscaling_on_keeps_the_replicas_until_the_hpa_scales(
        kube, operator, wait_for) -> None:
    def dep() -> dict:
        return kube.children().get(("Deployment", "demo-both")) or {"spec": {}, "metadata": {}}

    async def one_more_pass() -> None:
        await kube.delete("/api/v1/namespaces/default/services/demo-epp")
        await wait_for(lambda: ("Service", "demo-epp") in kube.children(), what="a later pass")

    async with operator(resync_s=0.3):
        await kube.create("demo", {**CPU, "pools": {"both": {"replicas": 3, "maxReplicas": 4}}})
        await wait_for(lambda: dep()["spec"].get("replicas") == 3, what="3 replicas")
        assert applies_field(dep(), wire.FIELD_MANAGER, REPLICAS)
        await kube.patch(f"{CRS}/demo", {"spec": {"autoscaling": {"enabled": True}}})
        await wait_for(lambda: ("ScaledObject", "demo-both") in kube.children(), what="KEDA")
        await wait_for(lambda: not applies_field(dep(), wire.FIELD_MANAGER, REPLICAS),
                       what="the operator lets go of spec.replicas")
        await one_more_pass()
        # Before the HPA's first write: still 3 (the API server's default would be 1).
        assert dep()["spec"]["replicas"] == 3
        assert owners(dep(), REPLICAS) == {HANDOVER_MANAGER}
        # The HPA scales: its write owns the count, the operator's passes leave it.
        await kube.scale("demo-both", 4)
        await one_more_pass()
        assert dep()["spec"]["replicas"] == 4
        assert owners(dep(), REPLICAS) == {"kube-controller-manager"}
        # Autoscaling off: the operator takes the count back.
        await kube.patch(f"{CRS}/demo", {"spec": {"autoscaling": {"enabled": False},
                                                  "pools": {"both": {"replicas": 2}}}})
        await wait_for(lambda: dep()["spec"].get("replicas") == 2, what="fixed again")
        assert owners(dep(), REPLICAS) == {wire.FIELD_MANAGER}
