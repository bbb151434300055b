"""A Kubernetes API for the operator's tests: kmock's emulator plus what kvyard relies on.

kmock stores objects, serves list/watch/get and discovery; on top of it this does what
a real API server does to the objects kvyard writes, so a test sees what a cluster
would: pruning of undeclared fields (status included) and the Deployment's defaults
(testing_schema.py, with what it leaves out), server-side apply with per-manager field
ownership and 409 conflicts between managers, `metadata.managedFields` included
(testing_ssa.py, with what it leaves out), the status and scale subresources (a write to
one changes nothing else; the main resource ignores status), uid/resourceVersion/
generation bookkeeping, finalizers, and the garbage collector's part (an object whose
owners are all gone is deleted, recursively) that kube-controller-manager does.
The controllers are played by the test: `settle()` reports every Deployment as rolled
out (the Deployment controller); `put_pods()` reports a Deployment's pods; a test
writes a Deployment's replicas through its scale subresource as KEDA's HPA does.
Not emulated, so a test here cannot show a fault in these: admission (validation and
CEL rules: schema_check.py runs those; unknown fields are pruned silently, never
refused as with fieldValidation=Strict); CRD schema defaults, pod-template and Service
defaults; merging of associative lists (`listType: map`: containers, env, ports are
one atomic field each here, owned whole) and per-element ownership; server-side apply
to a subresource (kvyard merge-patches status); resourceVersion preconditions other
than a JSON patch's `test`; dry-run; the controllers' own work beyond the helpers
above (ReplicaSets, rolling pods one by one, the HPA's decisions).
Needs the test extra (kmock).
"""
from __future__ import annotations

import copy
import datetime
import uuid
from typing import Any

import jsonpatch
import kmock
from kmock._internal import apps, enums, k8s
from kmock._internal.dicts import patch_dict

from kvyard.common import wire

from . import testing_schema, testing_ssa
from .client import KINDS

_SYSTEM_META = ("uid", "resourceVersion", "generation", "creationTimestamp",
                "deletionTimestamp", "finalizers", "namespace", "name")


def _merge_patch(old: Any, new: Any) -> Any:
    """The merge patch that turns `old` into `new` (None deletes a key)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    out = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old or old[k] != v:
            out[k] = _merge_patch(old.get(k), v)
    return out


class ApiServer(k8s.KubernetesEmulator):
    """Every resource kvyard uses, declared; `pools=False` leaves out the GAIE CRD."""

    def declare(self, pools: bool = True, keda: bool = True) -> "ApiServer":
        """`keda=False` leaves out KEDA's ScaledObject CRD."""
        for kind, (api, plural) in KINDS.items():
            if (kind == "InferencePool" and not pools) or (kind == "ScaledObject" and not keda):
                continue
            subs = ["status"] if kind in (wire.CRD_KIND, "Deployment", "InferencePool",
                                          "Pod") else []
            subs += ["scale"] if kind == "Deployment" else []
            self.resources[f"{api}/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=True, subresources=subs,
                verbs=["get", "list", "watch", "create", "patch", "delete"])
        self.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True,
                                                         verbs=["create"])
        # kopf waits for namespaces to be discoverable, even when it does not watch them.
        self.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False,
                                                             verbs=["get", "list", "watch"])
        self._rv = 0
        return self

    # -- bookkeeping ---------------------------------------------------------------
    def _next_rv(self) -> str:
        self._rv = getattr(self, "_rv", 0) + 1
        return str(self._rv)

    def live(self, plural: str | None = None) -> list[dict[str, Any]]:
        """Raw live objects (of one plural, or all)."""
        return [o.raw for (res, _, _), o in self._objects.items() if not o.deleted
                and (plural is None or res.plural == plural)]

    def get_live(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        for (res, ns, n), o in self._objects.items():
            if res.plural == plural and ns == namespace and n == name and not o.deleted:
                return o.raw
        return None

    async def _emit(self, res: Any, kind: str, raw: dict[str, Any]) -> None:
        event = {"type": kind, "object": raw}
        self.__dict__.setdefault("_log", []).append((getattr(self, "_rv", 0), res, event))
        await self._buses[res].put(event)

    async def _store(self, key: tuple, new: dict[str, Any], event: str) -> None:
        if key in self._objects and not self._objects[key].deleted:
            self._objects[key].patch(_merge_patch(self._objects[key].raw, new))
        elif key in self._objects:
            self._objects[key].create(new)
        else:
            self._objects[key] = new
        await self._emit(key[0], event, self._objects[key].raw)

    async def _remove(self, key: tuple) -> None:
        obj = self._objects[key]
        raw = obj.raw
        if raw["metadata"].get("finalizers"):
            if not raw["metadata"].get("deletionTimestamp"):
                now = datetime.datetime.now(datetime.timezone.utc).isoformat()
                await self._store(key, {**raw, "metadata": {
                    **raw["metadata"], "deletionTimestamp": now,
                    "resourceVersion": self._next_rv()}}, "MODIFIED")
            return
        obj.delete()
        await self._emit(key[0], "DELETED", raw)

    async def _collect_garbage(self) -> None:
        while True:
            alive = {o.raw["metadata"].get("uid") for o in self._objects.values()
                     if not o.deleted}
            orphans = [key for key, o in self._objects.items() if not o.deleted
                       and o.raw["metadata"].get("ownerReferences")
                       and not any(r.get("uid") in alive
                                   for r in o.raw["metadata"]["ownerReferences"])
                       and not o.raw["metadata"].get("deletionTimestamp")]
            if not orphans:
                return
            for key in orphans:
                await self._remove(key)

    def _owners(self, key: tuple, fresh: bool = False) -> testing_ssa.Ownership:
        owners = self.__dict__.setdefault("_ownership", {})
        if fresh or key not in owners:
            owners[key] = testing_ssa.Ownership()
        return owners[key]

    def _written(self, key: tuple, obj: dict[str, Any]) -> dict[str, Any]:
        """What the server stores: pruned, defaulted, with its managedFields."""
        obj = testing_schema.default(testing_schema.prune(obj))
        obj.setdefault("metadata", {})["managedFields"] = self._owners(key).managed_fields()
        return obj

    def _new(self, data: dict[str, Any], namespace: str | None) -> dict[str, Any]:
        obj = copy.deepcopy(data)
        md = obj.setdefault("metadata", {})
        md.update(namespace=md.get("namespace") or namespace, uid=str(uuid.uuid4()),
                  resourceVersion=self._next_rv(), generation=1,
                  creationTimestamp=datetime.datetime.now(datetime.timezone.utc)
                  .strftime("%Y-%m-%dT%H:%M:%SZ"))
        obj.pop("status", None)
        return obj

    def _next(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        spec_changed = any(old.get(k) != new.get(k) for k in set(old) | set(new)
                           if k not in ("metadata", "status"))
        md = new["metadata"]
        md["resourceVersion"] = self._next_rv()
        md["generation"] = old["metadata"].get("generation", 1) + (1 if spec_changed else 0)
        return new

    # -- request handling ------------------------------------------------------------
    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and request.action in (
                enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE):
            async with self._lock:
                await self._mutate(request)
                await self._collect_garbage()
        # Render the answer from the stored state (kmock's fallbacks), skipping the
        # emulator's own merge logic, which this class replaces.
        return await apps.RawHandler._handle(self, request)

    @staticmethod
    def _manager(request: Any) -> str:
        agent = request.headers.get("User-Agent", "") or "unknown"
        return request.params.get("fieldManager") or agent.split("/")[0].split(" ")[0]

    async def _mutate(self, request: Any) -> None:
        res, data = request.resource, request.data
        if not any(r == res for r in self.resources):
            raise k8s.KubernetesResourceNotFoundError()
        manager = self._manager(request)
        if request.action == enums.action.CREATE:
            md = (data or {}).get("metadata", {})
            key = (res, request.namespace or md.get("namespace"), md.get("name"))
            if key in self._objects and not self._objects[key].deleted:
                raise k8s.KubernetesObjectConflictError()
            new = self._new(testing_schema.prune(data), key[1])
            self._owners(key, fresh=True).update({}, new, manager)
            await self._store(key, self._written(key, new), "ADDED")
            return
        key = (res, request.namespace, request.name)
        exists = key in self._objects and not self._objects[key].deleted
        if request.action == enums.action.DELETE:
            if not exists:
                raise k8s.KubernetesObjectNotFoundError()
            await self._remove(key)
            return
        if "apply-patch" in request.headers.get("Content-Type", ""):
            await self._apply(key, exists, request, manager)
            return
        if not exists:
            raise k8s.KubernetesObjectNotFoundError()
        old = self._objects[key].raw
        if request.subresource in ("status", "scale"):
            new = self._subresource_write(old, request.subresource, data or {})
            self._owners(key).update(old, new, manager, request.subresource)
            self._owners(key).forget_unset(new)
            new = self._written(key, new)
            if request.subresource == "scale":
                new = self._next(old, new)
        else:
            try:
                new = dict(patch_dict(copy.deepcopy(old), data or {}))
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                # A failed `test` op (kopf's optimistic concurrency on resourceVersion): 422.
                raise k8s.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
            new.pop("status", None)
            if "status" in old:
                new["status"] = old["status"]
            new = testing_schema.default(testing_schema.prune(new))
            self._owners(key).update(old, new, manager)
            new = self._next(old, self._written(key, new))
        md = new["metadata"]
        if md.get("deletionTimestamp") and not md.get("finalizers"):
            self._objects[key].delete()
            await self._emit(res, "DELETED", new)
            return
        await self._store(key, new, "MODIFIED")

    def _subresource_write(self, old: dict[str, Any], sub: str, data: dict[str, Any]
                           ) -> dict[str, Any]:
        """A status write changes status only; a scale write, spec.replicas only."""
        if sub == "status":
            new = {**old, "status": patch_dict(old.get("status") or {},
                                                (data or {}).get("status") or {})}
        else:
            replicas = ((data or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int):
                raise k8s.KubernetesError(status=422, reason="Invalid",
                                          message="spec.replicas: an integer is required")
            new = {**old, "spec": {**old.get("spec", {}), "replicas": replicas}}
        return {**new, "metadata": {**old["metadata"], "resourceVersion": self._next_rv()}}

    async def _apply(self, key: tuple, exists: bool, request: Any, manager: str) -> None:
        """Server-side apply: the manager's fields become what it sent (testing_ssa)."""
        sent = testing_schema.prune({k: v for k, v in (request.data or {}).items()
                                     if k != "status"})
        force = request.params.get("force") == "true"
        old = self._objects[key].raw if exists else self._new(
            {k: sent[k] for k in ("apiVersion", "kind") if k in sent}
            | {"metadata": {"name": key[2]}}, key[1])
        owners = self._owners(key, fresh=not exists)
        try:
            new = owners.apply(old, sent, manager, force)
        except testing_ssa.Conflict as e:
            raise k8s.KubernetesError(status=409, reason="Conflict", message=str(e)) from e
        md = new["metadata"]
        for k in _SYSTEM_META:
            if k in old["metadata"]:
                md[k] = old["metadata"][k]
        if "status" in old:
            new["status"] = old["status"]
        new = self._written(key, new)
        if exists:
            await self._store(key, self._next(old, new), "MODIFIED")
        else:
            await self._store(key, new, "ADDED")

    async def _serve_list(self, request: Any) -> Any:
        doc = await super()._serve_list(request)
        return {**doc, "metadata": {"resourceVersion": str(getattr(self, "_rv", 0))}}

    async def _serve_watch(self, request: Any) -> Any:
        """A watch from a list's resourceVersion gets the changes since then (kmock's own
        replays the current objects, which made kopf act twice on a stale body); the bus
        is marked under the mutation lock, so no event falls between log and stream."""
        yield b""
        bus = self._buses[request.resource]
        since = request.params.get("resourceVersion")

        def matches(event: dict[str, Any]) -> bool:
            md = event.get("object", {}).get("metadata", {})
            return (request.namespace is None or md.get("namespace") == request.namespace) \
                and (request.name is None or md.get("name") == request.name)

        async with self._lock:
            marker = await bus.mark()
            if since and since.isdigit() and since != "0":
                backlog = [e for rv, res, e in self.__dict__.get("_log", [])
                           if res == request.resource and rv > int(since)]
            else:
                backlog = [{"type": "ADDED", "object": o.raw}
                           for (res, _, _), o in self._objects.items()
                           if res == request.resource and not o.deleted]
        for event in backlog:
            if matches(event):
                yield event
        async for event in bus.stream(since=marker):
            if matches(event):
                yield event

    # -- the Deployment controller's part ----------------------------------------------
    async def settle(self, ready: bool = True) -> int:
        """Report every Deployment as rolled out (ready) or as pods not ready yet;
        returns how many were changed."""
        changed = 0
        async with self._lock:
            for key, o in list(self._objects.items()):
                if o.deleted or key[0].plural != "deployments":
                    continue
                raw = o.raw
                n = int(raw["spec"].get("replicas", 1))
                status = {"observedGeneration": raw["metadata"]["generation"], "replicas": n,
                          "updatedReplicas": n, "readyReplicas": n if ready else 0,
                          "availableReplicas": n if ready else 0}
                if raw.get("status") != status:
                    await self._store(key, {**raw, "status": status, "metadata": {
                        **raw["metadata"], "resourceVersion": self._next_rv()}}, "MODIFIED")
                    changed += 1
        return changed


    # -- the scheduler's and kubelet's part -----------------------------------------------
    async def put_pods(self, namespace: str, deployment: str,
                       statuses: list[dict[str, Any]]) -> list[str]:
        """The Deployment's pods become one per status given (named <deployment>-<i>, its
        template's labels, owned by it); returns their names."""
        async with self._lock:
            dep = self.get_live("deployments", namespace, deployment)
            if dep is None:
                raise KeyError(deployment)
            res = next(r for r in self.resources if r.plural == "pods")
            names = [f"{deployment}-{i}" for i in range(len(statuses))]
            for key, o in list(self._objects.items()):
                if key[0] == res and key[1] == namespace and not o.deleted \
                        and key[2].startswith(f"{deployment}-") and key[2] not in names:
                    await self._remove(key)
            labels = dep["spec"]["template"]["metadata"].get("labels") or {}
            owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment,
                     "uid": dep["metadata"]["uid"], "controller": True}
            for name, st in zip(names, statuses):
                key = (res, namespace, name)
                old = self._objects[key].raw if key in self._objects \
                    and not self._objects[key].deleted else None
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
                    **(old["metadata"] if old else self._new({}, namespace)["metadata"]),
                    "name": name, "labels": labels, "ownerReferences": [owner],
                    "resourceVersion": self._next_rv()},
                    "spec": dep["spec"]["template"]["spec"], "status": st}
                await self._store(key, pod, "MODIFIED" if old else "ADDED")
        return names
