"""Owned Deployments and Pods as the operator's watches last saw them, by service.

kopf watches both kinds (label `app.kubernetes.io/managed-by: kvyard-operator`) and
every event lands here (`seen`), then wakes the service's daemon, which recomputes the
status from this view without reading the API (handlers.py). A full pass seeds the view
with what it read itself (`seed`: the Deployments its applies returned, the pods it
listed), so a view is complete from the service's first pass on; a newer copy never
gives way to an older one (resourceVersion), whichever path brought it.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvyard.common import wire

Key = tuple[str, str]      # (namespace, service)


def _rv(obj: dict[str, Any]) -> int | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


def service_of(obj: dict[str, Any]) -> Key | None:
    md = obj.get("metadata") or {}
    labels = md.get("labels") or {}
    if labels.get(wire.MANAGED_BY_LABEL) != wire.MANAGED_BY or wire.SERVICE_LABEL not in labels:
        return None
    return md.get("namespace") or "default", labels[wire.SERVICE_LABEL]


@dataclass(slots=True)
class Children:
    objects: dict[Key, dict[tuple[str, str], dict[str, Any]]] = field(default_factory=dict)
    changed: dict[Key, asyncio.Event] = field(default_factory=dict)
    full: set[Key] = field(default_factory=set)    # a pass must re-apply (a child went)

    def _newer(self, old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
        a, b = (_rv(old) if old else None), _rv(new)
        return a is None or b is None or b >= a

    def seen(self, kind: str, event_type: str | None, obj: dict[str, Any]) -> None:
        """A watch event: record it and wake the service's daemon."""
        key = service_of(obj)
        if key is None:
            return
        if event_type == "DELETED":
            self.objects.get(key, {}).pop((kind, obj["metadata"].get("name", "")), None)
            if kind == "Deployment":
                self.full.add(key)
        else:
            self.seed(key, kind, [obj])
        self.event(key).set()

    def seed(self, key: Key, kind: str, objs: list[dict[str, Any]],
             complete: bool = False) -> None:
        """What a pass read; `complete`: every object of the kind there is (a list)."""
        kids = self.objects.setdefault(key, {})
        if complete:
            names = {(o.get("metadata") or {}).get("name") for o in objs}
            for slot in [s for s in kids if s[0] == kind and s[1] not in names]:
                del kids[slot]
        for obj in objs:
            slot = (kind, (obj.get("metadata") or {}).get("name", ""))
            if self._newer(kids.get(slot), obj):
                kids[slot] = obj

    def of(self, key: Key, kind: str, names: list[str] | None = None) -> list[dict[str, Any]]:
        kids = self.objects.get(key, {})
        if names is None:
            return [o for (k, _), o in sorted(kids.items()) if k == kind]
        return [kids[(kind, n)] for n in names if (kind, n) in kids]

    def event(self, key: Key) -> asyncio.Event:
        return self.changed.setdefault(key, asyncio.Event())
