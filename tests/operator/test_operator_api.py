"""The operator (kopf, the real handlers) against an emulated Kubernetes API
(kvyard.operator.testing: kmock + server-side apply, status subresource, garbage
collection; `settle()` plays the Deployment controller). Create / update / delete,
exact children and owner references, status (Ready = serving, Progressing = rollouts),
drift repair within one resync, bad specs reported as Degraded, and an operator
restart in the middle of a pass converging to the same children."""
from __future__ import annotations

import asyncio
import socket

import pytest

from kvyard.operator.render import render_all
from kvyard.operator.spec import parse
from kvyard.operator.testing_schema import without_defaults

CRS = "/apis/kvyard.io/v1alpha1/namespaces/default/inferenceservices"
DEPS = "/apis/apps/v1/namespaces/default/deployments"
CPU = {"model": {"source": "demo"}, "kvstore": {"dramGB": 1}}
EXPECTED = {("Deployment", "demo-both"), ("Service", "demo-both"),
            ("ServiceAccount", "demo-epp"), ("Role", "demo-epp"), ("RoleBinding", "demo-epp"),
            ("ConfigMap", "demo-epp"), ("Deployment", "demo-epp"), ("Service", "demo-epp"),
            ("ConfigMap", "demo-gateway"), ("Deployment", "demo-gateway"),
            ("Service", "demo-gateway")}
_SERVER_FIELDS = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields")


def content(obj: dict, sent: dict | None = None) -> dict:
    """An object without what the server adds (metadata bookkeeping, status, and the
    defaults it filled in where `sent`, what the operator applied, left a field out)."""
    if sent is not None:
        obj = without_defaults(obj, sent)
    md = {k: v for k, v in obj["metadata"].items() if k not in _SERVER_FIELDS}
    if not md.get("annotations"):
        md.pop("annotations", None)
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": md}


def rendered(kube, name: str = "demo") -> dict:
    cr = kube.cr(name)
    return {(o["kind"], o["metadata"]["name"]): o for o in render_all(parse(cr))}


def live_content(kube, name: str = "demo") -> dict:
    want = rendered(kube, name)
    return {k: content(v, want.get(k)) for k, v in kube.children(name).items()}


def status(kube, kind: str) -> tuple[str, str]:
    c = kube.condition(kind)
    return c.get("status", ""), c.get("reason", "")


async def test_create_then_ready_only_after_the_rollout(kube, operator, wait_for) -> None:
    # A 30 s resync: Ready follows the rollout through the Deployment watch.
    async with operator(resync_s=30.0):
        cr = await kube.create("demo", CPU)
        uid = cr["metadata"]["uid"]
        await wait_for(lambda: set(kube.children()) == EXPECTED, what="children")
        for obj in kube.children().values():
            assert obj["metadata"]["ownerReferences"] == [{
                "apiVersion": "kvyard.io/v1alpha1", "kind": "InferenceService", "name": "demo",
                "uid": uid, "controller": True, "blockOwnerDeletion": True}]
        assert live_content(kube) == \
            {k: content(v) for k, v in rendered(kube).items()}
        await wait_for(lambda: status(kube, "Progressing") == ("True", "RollingOut"))
        assert status(kube, "Ready") == ("False", "RollingOut")
        await kube.api.settle(ready=False)  # pods exist, none ready
        await wait_for(lambda: kube.cr()["status"]["pools"]["both"]["updatedReplicas"] == 1)
        assert status(kube, "Ready") == ("False", "RollingOut")
        await kube.api.settle()
        await wait_for(lambda: status(kube, "Ready") == ("True", "Serving"), what="Ready")
        st = kube.cr()["status"]
        assert st["observedGeneration"] == 1
        assert st["pools"] == {"both": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}
        assert st["gatewayAddress"] == "demo-gateway.default.svc:8080"
        assert status(kube, "Progressing") == ("False", "RolledOut")
        assert status(kube, "Degraded") == ("False", "AsExpected")


async def test_spec_changes_roll_out_and_prune(kube, operator, wait_for) -> None:
    async with operator():
        await kube.create("demo", CPU)
        await wait_for(lambda: set(kube.children()) == EXPECTED)
        await kube.api.settle()
        await wait_for(lambda: status(kube, "Ready")[0] == "True")
        # More replicas: the new generation is Progressing until its rollout is done, and
        # the service keeps serving (Ready) from the replica it has meanwhile.
        await kube.patch(f"{CRS}/demo", {"spec": {"pools": {"both": {"maxReplicas": 3,
                                                                     "replicas": 3}}}})
        await wait_for(lambda: kube.children()[("Deployment", "demo-both")]["spec"]["replicas"]
                       == 3, what="scaled")
        await wait_for(lambda: kube.cr()["status"]["observedGeneration"] == 2)
        assert status(kube, "Progressing") == ("True", "RollingOut")
        assert status(kube, "Ready") == ("True", "Serving")
        await kube.api.settle()
        await wait_for(lambda: status(kube, "Progressing") == ("False", "RolledOut"))
        assert status(kube, "Ready")[0] == "True"
        # Both -> prefill + decode: the both pool is pruned, the P/D key appears once.
        await kube.patch(f"{CRS}/demo", {"spec": {"pools": {"both": None, "prefill": {},
                                                            "decode": {}}}})
        want = (EXPECTED - {("Deployment", "demo-both"), ("Service", "demo-both")}) | {
            ("Deployment", "demo-prefill"), ("Service", "demo-prefill"),
            ("Deployment", "demo-decode"), ("Service", "demo-decode"),
            ("Secret", "demo-pd-key")}
        await wait_for(lambda: set(kube.children()) == want, what="P/D children")
        key = kube.children()[("Secret", "demo-pd-key")]["data"]["key"]
        await kube.api.settle()
        await wait_for(lambda: status(kube, "Ready")[0] == "True"
                       and set(kube.cr()["status"]["pools"]) == {"prefill", "decode"})
        assert kube.children()[("Secret", "demo-pd-key")]["data"]["key"] == key


async def test_drift_is_repaired_within_one_resync(kube, operator, wait_for) -> None:
    async with operator(resync_s=1.0):
        await kube.create("demo", CPU)
        await wait_for(lambda: set(kube.children()) == EXPECTED)
        want = {k: content(v) for k, v in kube.children().items()}
        edited = await kube.patch(f"{DEPS}/demo-both", {"spec": {"replicas": 7}})
        assert edited["spec"]["replicas"] == 7
        await kube.patch("/api/v1/namespaces/default/configmaps/demo-epp",
                         {"data": {"scheduler.yaml": "blockSize: 1\n"}})
        await kube.delete("/api/v1/namespaces/default/services/demo-epp")
        await kube.delete(f"{DEPS}/demo-gateway")
        # One resync period (1 s) plus the pass; generous for a loaded 2-core box.
        await wait_for(lambda: {k: content(v) for k, v in kube.children().items()} == want,
                       timeout=1.0 + 5.0, what="repaired children")


async def test_delete_removes_everything_also_after_a_restart(kube, operator, wait_for) -> None:
    async with operator():
        await kube.create("demo", CPU)
        await kube.create("other", CPU)
        await wait_for(lambda: set(kube.children()) == EXPECTED and len(kube.children("other"))
                       == len(EXPECTED))
        await kube.delete(f"{CRS}/demo")
        await wait_for(lambda: kube.cr() is None and not kube.children(), what="cleanup")
    # Operator down: the object waits on kopf's finalizer; back up, it goes with its children.
    await kube.delete(f"{CRS}/other")
    assert kube.cr("other")["metadata"]["deletionTimestamp"]
    assert len(kube.children("other")) == len(EXPECTED)
    async with operator():
        await wait_for(lambda: kube.cr("other") is None and not kube.children("other"),
                       what="cleanup after restart")
    assert kube.api.live() == []


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("spec, reason, says", [
    ({"engine": {"name": "tgi"}}, "InvalidSpec", "unknown engine"),
    ({"pools": {"both": {"replicas": -1}}}, "InvalidSpec", "spec.pools.both.replicas"),
    ({"kvstore": {"redis": {"url": "redis://127.0.0.1:6379",
                            "secretRef": {"name": "absent"}}}},
     "SecretNotFound", "Secret absent"),
], ids=["engine", "replicas", "secret"])
async def test_bad_specs_are_degraded_and_nothing_is_applied(kube, operator, wait_for,
                                                             spec, reason, says) -> None:
    async with operator() as task:
        await kube.create("demo", spec)
        await wait_for(lambda: status(kube, "Degraded")[0] == "True", what="Degraded")
        assert status(kube, "Degraded") == ("True", reason)
        assert says in kube.condition("Degraded")["message"]
        assert status(kube, "Ready") == ("False", reason)
        assert kube.children() == {}
        assert not task.done()  # reported, not crashed


async def test_redis_secret_then_unreachable_redis(kube, operator, wait_for) -> None:
    url = f"redis://127.0.0.1:{closed_port()}"
    async with operator(resync_s=0.5):
        await kube.create("demo", {"kvstore": {"redis": {"url": url,
                                                         "secretRef": {"name": "redis"}}}})
        await wait_for(lambda: status(kube, "Degraded") == ("True", "SecretNotFound"))
        await kube.call("POST", "/api/v1/namespaces/default/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "redis"},
            "data": {"password": "c2VjcmV0"}}, "application/json")
        # The next resync finds the Secret: children applied; Redis is down, so Degraded
        # says so (workers run without the tier until it answers), not blocking.
        await wait_for(lambda: set(kube.children()) == EXPECTED, what="children")
        await wait_for(lambda: status(kube, "Degraded") == ("True", "RedisUnreachable"))
        assert url.rpartition(":")[2] in kube.condition("Degraded")["message"]
        env = kube.children()[("Deployment", "demo-both")]["spec"]["template"]["spec"][
            "containers"][0]["env"]
        assert {"name": "KVYARD_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": "redis", "key": "password"}}} in env


@pytest.mark.no_inference_pool_crd
async def test_inference_pool_without_its_crd_is_degraded(kube, operator, wait_for) -> None:
    async with operator():
        await kube.create("demo", {"inferencePool": {"enabled": True}})
        await wait_for(lambda: status(kube, "Degraded") == ("True", "InferencePoolCRDMissing"))
        assert set(kube.children()) == EXPECTED  # the rest is served


async def test_inference_pool_is_created_and_pruned(kube, operator, wait_for) -> None:
    async with operator():
        await kube.create("demo", {"inferencePool": {"enabled": True}})
        await wait_for(lambda: ("InferencePool", "demo") in kube.children())
        pool = kube.children()[("InferencePool", "demo")]
        assert pool["spec"]["endpointPickerRef"]["name"] == "demo-epp"
        await kube.patch(f"{CRS}/demo", {"spec": {"inferencePool": {"enabled": False}}})
        await wait_for(lambda: set(kube.children()) == EXPECTED, what="pool pruned")


async def test_restart_mid_pass_converges_to_the_same_children(kube, operator, api,
                                                               wait_for) -> None:
    """The operator is killed while its first pass hangs on its 5th apply (which never
    lands); a new operator completes the same children."""
    from kmock._internal.k8s import KubernetesError

    from kvyard.operator.handlers import OperatorConfig, run_operator

    applies, hung, release = 0, asyncio.Event(), asyncio.Event()
    original = type(api)._mutate

    async def cut_after_four(self, request):
        nonlocal applies
        if "apply-patch" in request.headers.get("Content-Type", ""):
            applies += 1
            if applies > 4:
                hung.set()
                await release.wait()
                raise KubernetesError(status=503, reason="ServiceUnavailable")
        return await original(self, request)

    type(api)._mutate = cut_after_four
    try:
        cfg = OperatorConfig(resync_s=30.0, retry_s=0.2, server=str(api.url))
        first = asyncio.create_task(run_operator(cfg, ["default"], clusterwide=False))
        await kube.create("demo", CPU)
        await wait_for(hung.is_set, what="the 5th apply")
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    finally:
        type(api)._mutate = original
        release.set()
    partial = set(kube.children())
    assert len(partial) == 4 and partial < EXPECTED, partial
    async with operator(resync_s=30.0):
        await wait_for(lambda: set(kube.children()) == EXPECTED, what="converged")
        await wait_for(lambda: status(kube, "Progressing")[0] == "True")
    assert live_content(kube) == \
        {k: content(v) for k, v in rendered(kube).items()}


async def test_a_recreated_service_leaves_no_orphans(kube, operator, wait_for) -> None:
    """`helm upgrade --force` deletes and recreates the object (a new uid): the children end
    owned by the new one, none left behind with the old owner."""
    async with operator():
        old = (await kube.create("demo", CPU))["metadata"]["uid"]
        await wait_for(lambda: set(kube.children()) == EXPECTED)
        await kube.delete(f"{CRS}/demo")
        await wait_for(lambda: kube.cr() is None)
        new = (await kube.create("demo", {**CPU, "pools": {"both": {"maxReplicas": 2,
                                                                    "replicas": 2}}}))["metadata"]["uid"]
        assert new != old

        def adopted() -> bool:
            kids = kube.children()
            return set(kids) == EXPECTED and all(
                [r["uid"] for r in o["metadata"]["ownerReferences"]] == [new]
                for o in kids.values())
        await wait_for(adopted, what="children owned by the new object")
        assert kube.children()[("Deployment", "demo-both")]["spec"]["replicas"] == 2
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == new for o in kube.api.live()
               if o["metadata"].get("ownerReferences"))



async def test_status_holds_only_what_the_crd_declares(kube, operator, wait_for) -> None:
    """kopf stores a handler's return value under status.<handler id>: the handlers return
    nothing, so after a create and an update the status has only the schema's fields."""
    import json

    from kvyard.operator.schema import STATUS

    def handled() -> bool:
        """kopf finished the handlers for the current spec (its diff base is that spec,
        no handler's progress is pending)."""
        cr = kube.cr() or {}
        notes = cr["metadata"].get("annotations") or {}
        last = notes.get("kvyard.io/last-handled-configuration")
        return bool(last) and json.loads(last).get("spec") == cr["spec"] \
            and not any(k.startswith("kvyard.io/reconcile-") for k in notes)

    declared = set(STATUS["properties"]) - {"kopf"}
    async with operator(resync_s=30.0):
        await kube.create("demo", CPU)
        await wait_for(handled, what="the create handled")
        await wait_for(lambda: "conditions" in (kube.cr().get("status") or {}))
        assert set(kube.cr()["status"]) <= declared, kube.cr()["status"]
        await kube.patch(f"{CRS}/demo", {"spec": {"pools": {"both": {"maxReplicas": 2,
                                                                     "replicas": 2}}}})
        await wait_for(lambda: kube.cr()["status"].get("observedGeneration") == 2)
        await wait_for(handled, what="the update handled")
        assert set(kube.cr()["status"]) <= declared, kube.cr()["status"]
