"""What the conditions mean (status.py, pure): Ready = serving, Progressing = rollouts and
scale-ups, Degraded = failures with the pods' own reasons at once; and through the real
handlers against the emulated API: the status follows Deployments and pods through
watches (a 30 s resync never comes in these tests) with no reads of the API."""
from __future__ import annotations

from kvyard.common import wire
from kvyard.operator.status import Observed, compute

CPU = {"model": {"source": "demo"}}
NOW = "2026-01-01T00:00:00Z"
GPU_MESSAGE = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."


def deployment(name: str, component: str, role: str | None = None, desired: int = 1,
               ready: int | None = None, updated: int | None = None, total: int | None = None,
               generation: int = 1, seen: int = 1) -> dict:
    ready = desired if ready is None else ready
    labels = {wire.COMPONENT_LABEL: component, **({wire.ROLE_LABEL: role} if role else {})}
    return {"metadata": {"name": name, "labels": labels, "generation": generation},
            "spec": {"replicas": desired},
            "status": {"observedGeneration": seen, "replicas": desired if total is None else total,
                       "updatedReplicas": desired if updated is None else updated,
                       "readyReplicas": ready, "availableReplicas": ready}}


def front(ready: int = 1) -> list[dict]:
    return [deployment("demo-epp", "epp", ready=ready),
            deployment("demo-gateway", "gateway", ready=ready)]


def waiting(name: str, reason: str, message: str = "") -> dict:
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "worker", "ready": False,
         "state": {"waiting": {"reason": reason, "message": message}}}]}}


def unschedulable(name: str) -> dict:
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": GPU_MESSAGE}]}}


def conditions(deps: list[dict], pods: list[dict] | None = None, **kw: object) -> dict:
    obs = Observed(generation=1, deployments=deps, expected_deployments=len(deps),
                   pods=pods or [], **kw)
    return {c["type"]: (c["status"], c["reason"], c["message"])
            for c in compute(obs, None, NOW)["conditions"]}


def test_a_scale_up_is_progressing_and_still_ready() -> None:
    # KEDA's HPA takes the pool from 2 to 3: the two serve while the third starts.
    c = conditions(front() + [deployment("demo-both", "worker", "both", desired=3, ready=2,
                                         generation=2, seen=2)])
    assert c["Ready"][:2] == ("True", "Serving")
    assert c["Progressing"][:2] == ("True", "RollingOut")
    assert "demo-both: 2/3 ready" in c["Progressing"][2]
    assert c["Degraded"][:2] == ("False", "AsExpected")


def test_seven_of_eight_is_ready_and_a_rollout_serves_from_the_old_pods() -> None:
    c = conditions(front() + [deployment("demo-both", "worker", "both", desired=8, ready=7)])
    assert c["Ready"][:2] == ("True", "Serving") and c["Progressing"][0] == "True"
    # A new template: the controller has not seen it yet, the old pods serve.
    c = conditions(front() + [deployment("demo-both", "worker", "both", desired=2,
                                         updated=0, generation=3, seen=2)])
    assert c["Ready"][:2] == ("True", "Serving")
    assert "not seen yet" in c["Progressing"][2]


def test_not_ready_until_every_serving_part_has_a_pod() -> None:
    workers = [deployment("demo-prefill", "worker", "prefill"),
               deployment("demo-decode", "worker", "decode")]
    assert conditions(front(ready=1) + workers)["Ready"][0] == "True"
    c = conditions(front(ready=0) + workers)
    assert c["Ready"][:2] == ("False", "RollingOut") and "demo-epp" in c["Ready"][2]
    c = conditions(front() + [workers[0], deployment("demo-decode", "worker", "decode",
                                                     ready=0)])
    assert c["Ready"][0] == "False" and "demo-decode" in c["Ready"][2]
    # A pool KEDA keeps at zero by design does not hold Ready back.
    c = conditions(front() + [deployment("demo-prefill", "worker", "prefill", desired=0),
                              workers[1]], wakes_from_zero=True)
    assert c["Ready"][:2] == ("True", "Serving")
    # Nor one KEDA is waking while the decode pool serves; without KEDA it is a pool down.
    waking = deployment("demo-prefill", "worker", "prefill", desired=1, ready=0)
    assert conditions(front() + [waking, workers[1]], wakes_from_zero=True)["Ready"][0] == "True"
    assert conditions(front() + [waking, workers[1]])["Ready"][0] == "False"
    # Every decode/both pool at zero by design: Ready, the first request wakes one.
    c = conditions(front() + [deployment("demo-both", "worker", "both", desired=0)],
                   wakes_from_zero=True)
    assert c["Ready"][:2] == ("True", "ScaledToZero")


def test_pod_failures_are_degraded_at_once() -> None:
    deps = front() + [deployment("demo-both", "worker", "both", desired=3, ready=1)]
    c = conditions(deps, [waiting("demo-both-b", "ImagePullBackOff",
                                  'Back-off pulling image "kvyard:nope"'),
                          waiting("demo-both-c", "ImagePullBackOff", "again")])
    assert c["Degraded"][:2] == ("True", "ImagePullBackOff")
    assert 'demo-both-b: container worker: Back-off pulling image "kvyard:nope" (and 1 more' \
        in c["Degraded"][2]
    assert c["Ready"][:2] == ("True", "Serving")   # one pod still serves
    c = conditions(deps, [waiting("demo-both-b", "CrashLoopBackOff", "back-off 5m0s")])
    assert c["Degraded"][:2] == ("True", "CrashLoopBackOff")
    # Nothing serves: Ready says why, with the scheduler's own words.
    deps = front() + [deployment("demo-both", "worker", "both", desired=1, ready=0)]
    c = conditions(deps, [unschedulable("demo-both-a")])
    assert c["Degraded"][:2] == ("True", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in c["Degraded"][2]
    assert c["Ready"][:2] == ("False", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in c["Ready"][2]


# --- through the watches ------------------------------------------------------------------------

def status(kube, kind: str) -> tuple[str, str]:
    c = kube.condition(kind)
    return c.get("status", ""), c.get("reason", "")


async def test_the_status_follows_deployments_and_pods_through_watches(
        kube, operator, wait_for) -> None:
    reads: list[str] = []
    watches: dict[str, str | None] = {}
    counting = False
    original = type(kube.api)._handle

    async def counted(self, request):
        if request.resource is not None and request.params.get("watch") == "true":
            watches[request.resource.plural] = request.params.get("labelSelector")
        elif counting and request.resource is not None and request.resource.plural != "events":
            reads.append(f"{str(request.method).rpartition('.')[2]} {request.resource.plural}"
                         f"{'/' + request.subresource if request.subresource else ''}")
        return await original(self, request)

    type(kube.api)._handle = counted
    try:
        async with operator(resync_s=30.0):
            await kube.create("demo", CPU)
            await wait_for(lambda: ("Deployment", "demo-both") in kube.children(),
                           what="children")
            await wait_for(lambda: status(kube, "Progressing") == ("True", "RollingOut"))
            counting = True
            await kube.api.settle()
            await wait_for(lambda: status(kube, "Ready") == ("True", "Serving"), what="Ready")
            # A pod that cannot pull its image: Degraded with the kubelet's reason.
            await kube.api.put_pods("default", "demo-both", [
                {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
                waiting("x", "ImagePullBackOff", 'Back-off pulling image "x"')["status"]])
            await wait_for(lambda: status(kube, "Degraded") == ("True", "ImagePullBackOff"),
                           what="Degraded from the pod")
            assert "demo-both-1" in kube.condition("Degraded")["message"]
            await kube.api.put_pods("default", "demo-both", [
                {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}])
            await wait_for(lambda: status(kube, "Degraded") == ("False", "AsExpected"))
            counting = False
    finally:
        type(kube.api)._handle = original
    # Only the operator's own Deployments and pods are streamed (a server-side selector).
    assert watches["deployments"] == watches["pods"] == \
        f"{wire.MANAGED_BY_LABEL}={wire.MANAGED_BY}"
    # Status writes only (and kopf's own annotations): no reads, no passes.
    assert "PATCH inferenceservices/status" in reads
    assert set(reads) <= {"PATCH inferenceservices/status", "PATCH inferenceservices"}, reads
