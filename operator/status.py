"""Children as observed -> the InferenceService's status (pure).

The conditions mean what Kubernetes' own workloads mean by them:
- Ready: the service serves. The gateway and the EPP are available, every worker pool
  that wants pods has a ready one (a prefill pool KEDA is waking from zero excepted) and
  a decode/both worker serves, or every decode/both pool is at zero by design (KEDA wakes
  one for the first request). A rollout, a KEDA scale-up or 7 of 8 pods ready leave
  it Ready.
- Progressing: a child is not rolled out yet: not created, its controller has not seen
  its latest generation, or not every replica is updated, ready and available with no
  old pod left (rollouts and scale-ups alike).
- Degraded: failures, with the pods' own reasons as soon as a pod shows them
  (ImagePullBackOff, CrashLoopBackOff, Unschedulable with the scheduler's message, ...),
  not only after a Deployment's progress deadline.
The status only claims the generation whose children were applied.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvyard.common import wire


@dataclass(slots=True)
class Problem:
    """Why the service is Degraded. `blocking`: nothing was rolled out for it."""

    reason: str
    message: str
    blocking: bool = False


# A container waiting for one of these will not start without a change (or a long back-off).
FAILING_WAITS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff",
                 "CreateContainerConfigError", "CreateContainerError", "RunContainerError")


@dataclass(slots=True)
class Rollout:
    name: str
    role: str | None            # a worker pool's role; None for the EPP and gateway
    failure: str | None         # a ReplicaFailure condition's message (quota, admission)
    desired: int
    updated: int
    ready: int
    available: int
    current: bool               # controller saw the latest generation
    total: int                  # pods of any revision
    stuck: bool                 # ProgressDeadlineExceeded
    pool: str | None = None     # an extra model's pool (kvyard.io/pool; operator/models.py)

    @property
    def done(self) -> bool:
        return self.current and self.updated >= self.desired and self.total <= self.desired \
            and self.available >= self.desired and self.ready >= self.desired


def rollout(dep: dict[str, Any]) -> Rollout:
    md, spec, st = dep.get("metadata", {}), dep.get("spec", {}), dep.get("status") or {}
    desired = int(spec.get("replicas", 1))
    stuck = any(c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
                for c in st.get("conditions") or [])
    labels = md.get("labels") or {}
    role = labels.get(wire.ROLE_LABEL) if labels.get(wire.COMPONENT_LABEL) == "worker" else None
    failure = next((c.get("message") or c.get("reason") or "ReplicaFailure"
                    for c in st.get("conditions") or []
                    if c.get("type") == "ReplicaFailure" and c.get("status") == "True"), None)
    return Rollout(name=md.get("name", ""), role=role, failure=failure, desired=desired,
                   updated=int(st.get("updatedReplicas") or 0),
                   ready=int(st.get("readyReplicas") or 0),
                   available=int(st.get("availableReplicas") or 0),
                   current=int(st.get("observedGeneration") or 0) >= int(md.get("generation") or 1),
                   total=int(st.get("replicas") or 0), stuck=stuck,
                   pool=labels.get(wire.POOL_LABEL))


@dataclass(slots=True)
class Observed:
    generation: int                     # of the spec the children were rendered from
    deployments: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    gateway_address: str | None = None
    expected_deployments: int = 0       # children rendered; fewer seen = not created yet
    wakes_from_zero: bool = False       # KEDA scales the pools from zero (scale-to-zero on)
    pods: list[dict[str, Any]] = field(default_factory=list)   # the service's pods
    models: list[dict[str, Any]] = field(default_factory=list)  # base models, their adapters


def _pod_failure(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when a pod shows why it will not become ready."""
    st = pod.get("status") or {}
    for c in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILING_WAITS:
            detail = waiting.get("message") or waiting["reason"]
            return waiting["reason"], f"container {c.get('name')}: {detail}"
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return "Unschedulable", cond.get("message") or "no node fits the pod"
    return None


def pod_problems(pods: list[dict[str, Any]]) -> list[Problem]:
    """One problem per reason, naming the first pod and how many more show it."""
    found: dict[str, list[str]] = {}
    for pod in pods:
        md = pod.get("metadata") or {}
        failure = None if md.get("deletionTimestamp") else _pod_failure(pod)
        if failure:
            found.setdefault(failure[0], []).append(f"{md.get('name')}: {failure[1]}")
    return [Problem(reason, msgs[0] + (f" (and {len(msgs) - 1} more pod(s))"
                                       if len(msgs) > 1 else ""))
            for reason, msgs in found.items()]


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = old["lastTransitionTime"] if old and old.get("status") == status \
        and old.get("lastTransitionTime") else now
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def _progress(r: Rollout) -> str:
    if not r.current:
        return f"{r.name}: new generation not seen yet"
    return f"{r.name}: {r.ready}/{r.desired} ready, {r.updated} updated"


def compute(obs: Observed, previous: list[dict[str, Any]] | None, now: str) -> dict[str, Any]:
    prev = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    rolls = [rollout(d) for d in obs.deployments]
    missing = obs.expected_deployments - len(rolls)
    pending = [r for r in rolls if not r.done]
    blocking = [p for p in obs.problems if p.blocking]
    from_pods = pod_problems(obs.pods)
    problems = list(obs.problems) + from_pods + [
        Problem("ReplicaFailure", f"{r.name}: {r.failure}") for r in rolls if r.failure] + [
        Problem("RolloutStuck", f"{r.name}: progress deadline exceeded")
        for r in rolls if r.stuck]
    progressing = bool(pending or missing > 0) and not blocking
    workers = [r for r in rolls if r.role]
    # A pool that wants no pod (KEDA's zero, or replicas 0) holds nothing back; nor does a
    # prefill pool KEDA is waking (decode workers serve meanwhile).
    held = [r.name for r in workers if r.ready == 0 and r.desired > 0
            and not (obs.wakes_from_zero and r.role == "prefill")]
    waiting = [r.name for r in rolls if r.role is None and r.available == 0] + held
    serving = [r for r in workers if r.ready > 0 and r.role in ("both", "decode")]
    # At zero by design: the EPP holds requests and KEDA wakes a pool for them.
    at_zero = obs.wakes_from_zero and all(r.desired == 0 for r in workers
                                          if r.role in ("both", "decode"))
    if blocking:
        ready = (False, blocking[0].reason, blocking[0].message)
    elif missing > 0 or waiting or not workers:
        why = from_pods[0] if from_pods else None
        reason = why.reason if why else ("RollingOut" if progressing else "NoWorkers")
        ready = (False, reason, "waiting for " + ", ".join(waiting or ["children"])
                 + (f" ({why.message})" if why else ""))
    elif serving:
        ready = (True, "Serving", f"{sum(r.ready for r in serving)} worker(s) serving")
    elif at_zero:
        ready = (True, "ScaledToZero", "no worker runs; the first request wakes one (KEDA)")
    else:
        ready = (False, "NoWorkers", "no decode or both worker wants a pod (replicas 0)")
    g = obs.generation
    conds = [
        _condition("Ready", ready[0], ready[1], ready[2], g, prev, now),
        _condition("Progressing", progressing, "RollingOut" if progressing else
                   ("Blocked" if blocking else "RolledOut"),
                   "; ".join([_progress(r) for r in pending]
                             + ([f"{missing} child Deployment(s) not created yet"]
                                if missing > 0 else [])) if progressing else "",
                   g, prev, now),
        _condition("Degraded", bool(problems), problems[0].reason if problems else "AsExpected",
                   "; ".join(f"{p.reason}: {p.message}" for p in problems), g, prev, now),
    ]
    pools = {(f"{r.pool}-{r.role}" if r.pool else r.role): {
        "replicas": r.desired, "readyReplicas": r.ready, "updatedReplicas": r.updated}
        for r in rolls if r.role}
    out: dict[str, Any] = {"observedGeneration": g, "conditions": conds, "pools": pools}
    if obs.models:
        out["models"] = obs.models
    if obs.gateway_address:
        out["gatewayAddress"] = obs.gateway_address
    return out
