"""Children as observed -> the InferenceService's status (pure).

Never Ready mid-rollout: a Deployment counts as rolled out only when its
controller has seen its latest generation (observedGeneration == generation)
and every replica is updated, ready and available with no old pod left, and
the status only claims the generation whose children were applied.
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


@dataclass(slots=True)
class Rollout:
    name: str
    role: str | None            # a worker pool's role; None for the EPP and gateway
    desired: int
    updated: int
    ready: int
    available: int
    current: bool               # controller saw the latest generation
    total: int                  # pods of any revision
    stuck: bool                 # ProgressDeadlineExceeded

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
    return Rollout(name=md.get("name", ""), role=role, desired=desired,
                   updated=int(st.get("updatedReplicas") or 0),
                   ready=int(st.get("readyReplicas") or 0),
                   available=int(st.get("availableReplicas") or 0),
                   current=int(st.get("observedGeneration") or 0) >= int(md.get("generation") or 1),
                   total=int(st.get("replicas") or 0), stuck=stuck)


@dataclass(slots=True)
class Observed:
    generation: int                     # of the spec the children were rendered from
    deployments: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    gateway_address: str | None = None
    expected_deployments: int = 0       # children rendered; fewer seen = not created yet
    wakes_from_zero: bool = False       # KEDA scales the pools from zero (scale-to-zero on)


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = old["lastTransitionTime"] if old and old.get("status") == status \
        and old.get("lastTransitionTime") else now
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def compute(obs: Observed, previous: list[dict[str, Any]] | None, now: str) -> dict[str, Any]:
    prev = {c.get("type"): c for c in previous or [] if isinstance(c, dict)}
    rolls = [rollout(d) for d in obs.deployments]
    missing = obs.expected_deployments - len(rolls)
    pending = [r.name for r in rolls if not r.done]
    stuck = [r.name for r in rolls if r.stuck]
    blocking = [p for p in obs.problems if p.blocking]
    problems = list(obs.problems) + [Problem("RolloutStuck", f"{n}: progress deadline exceeded")
                                     for n in stuck]
    progressing = bool(pending or missing > 0) and not blocking
    serving = [r for r in rolls if r.role in ("both", "decode") and r.ready > 0]
    # At zero by design: the EPP holds requests and KEDA wakes a pool for them.
    at_zero = obs.wakes_from_zero and any(r.role in ("both", "decode") for r in rolls) and all(
        r.desired == 0 for r in rolls if r.role in ("both", "decode"))
    if blocking:
        ready = (False, blocking[0].reason, blocking[0].message)
    elif progressing:
        ready = (False, "RollingOut", "waiting for " + ", ".join(pending or ["children"]))
    elif not serving and at_zero:
        ready = (True, "ScaledToZero", "no worker runs; the first request wakes one (KEDA)")
    elif not serving:
        ready = (False, "NoWorkers", "no decode or both worker is ready (scaled to zero?)")
    else:
        ready = (True, "Serving", f"{sum(r.ready for r in serving)} worker(s) serving")
    g = obs.generation
    conds = [
        _condition("Ready", ready[0], ready[1], ready[2], g, prev, now),
        _condition("Progressing", progressing, "RollingOut" if progressing else
                   ("Blocked" if blocking else "RolledOut"),
                   ", ".join(pending) if progressing else "", g, prev, now),
        _condition("Degraded", bool(problems), problems[0].reason if problems else "AsExpected",
                   "; ".join(f"{p.reason}: {p.message}" for p in problems), g, prev, now),
    ]
    pools = {r.role: {"replicas": r.desired, "readyReplicas": r.ready,
                      "updatedReplicas": r.updated} for r in rolls if r.role}
    out: dict[str, Any] = {"observedGeneration": g, "conditions": conds, "pools": pools}
    if obs.gateway_address:
        out["gatewayAddress"] = obs.gateway_address
    return out
