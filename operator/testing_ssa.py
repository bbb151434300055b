"""Field ownership as the API server keeps it in `metadata.managedFields` (for testing.py).

No Python library implements structured-merge-diff (the API server's Go code), so this
is the subset kvyard's behaviour depends on, with the API server's rules for it:

- A field is a path of map keys; every list is atomic (one field, replaced whole).
  Real server-side apply merges lists marked `listType: map` (containers, env, ports)
  per key, and tracks ownership per element; here the whole list is one field.
- Apply (`application/apply-patch+yaml`) by manager M: M's field set becomes exactly
  the fields it sent. A sent field another manager owns with a different value is a
  conflict: 409 Conflict naming manager and field, unless `force=true`, which takes
  the field from them. The same value is shared ownership. A field M applied before
  and no longer sends is removed from the object unless another manager owns it, and
  a removed defaulted field (a Deployment's replicas) comes back as its default.
- Any other write (create, merge/JSON patch, a status or scale subresource write) is
  an Update: the fields whose value it changed become the writer's, taken from every
  other manager without a conflict (that is how an HPA's scale write takes
  spec.replicas); fields it removed leave every manager.
- Managed: metadata.labels, metadata.annotations, metadata.ownerReferences and every
  top-level field but apiVersion, kind, metadata and status; a status subresource
  write manages status. Defaulted values belong to no manager.
The manager's name is the request's `fieldManager` parameter, else the User-Agent's
product name (as the API server does).
"""
from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, field
from typing import Any

Path = tuple[str, ...]
_META_MANAGED = ("labels", "annotations", "ownerReferences")


class Conflict(Exception):
    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        self.conflicts = conflicts
        fields = ", ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {fields}")


def leaves(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every field (path -> value); an empty map or any list is one field."""
    if not isinstance(obj, dict) or (not obj and prefix):
        return {prefix: obj}
    out: dict[Path, Any] = {}
    for k, v in obj.items():
        out.update(leaves(v, prefix + (k,)))
    return out


def managed(obj: dict[str, Any], subresource: str = "") -> dict[Path, Any]:
    """The fields of an object that ownership is tracked for."""
    if subresource == "status":
        return leaves(obj.get("status") or {}, ("status",)) if obj.get("status") else {}
    out: dict[Path, Any] = {}
    md = obj.get("metadata") or {}
    for k in _META_MANAGED:
        if k in md:
            out.update(leaves(md[k], ("metadata", k)))
    for k, v in obj.items():
        if k not in ("apiVersion", "kind", "metadata", "status"):
            out.update(leaves(v, (k,)))
    return out


def _overlaps(a: Path, b: Path) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


_MISSING = object()


def value_at(obj: Any, path: Path) -> Any:
    for k in path:
        if not isinstance(obj, dict) or k not in obj:
            return _MISSING
        obj = obj[k]
    return obj


def _remove(obj: dict[str, Any], path: Path, keep: set[Path]) -> None:
    """Delete a field, then the maps it leaves empty that nobody owns as a field."""
    parents = [obj]
    for k in path[:-1]:
        nxt = parents[-1].get(k)
        if not isinstance(nxt, dict):
            return
        parents.append(nxt)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth] or path[:depth] in keep:
            return
        parents[depth - 1].pop(path[depth - 1], None)


def _set(obj: dict[str, Any], path: Path, value: Any) -> None:
    for k in path[:-1]:
        if not isinstance(obj.get(k), dict):
            obj[k] = {}
        obj = obj[k]
    obj[path[-1]] = copy.deepcopy(value)


@dataclass(slots=True)
class Entry:
    manager: str
    operation: str          # Apply | Update
    subresource: str        # "" | status | scale
    api_version: str
    fields: set[Path] = field(default_factory=set)
    time: str = ""


def _fields_v1(paths: set[Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in sorted(paths):
        node = out
        for k in p:
            node = node.setdefault(f"f:{k}", {})
    return out


@dataclass(slots=True)
class Ownership:
    """One object's managers."""

    entries: dict[tuple[str, str, str], Entry] = field(default_factory=dict)

    def _entry(self, manager: str, operation: str, subresource: str, api: str) -> Entry:
        key = (manager, operation, subresource)
        if key not in self.entries:
            self.entries[key] = Entry(manager, operation, subresource, api)
        e = self.entries[key]
        e.time = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return e

    def owned(self, exclude: tuple[str, str, str] | None = None) -> set[Path]:
        return {p for k, e in self.entries.items() if k != exclude for p in e.fields}

    def _take(self, path: Path, keep: tuple[str, str, str]) -> None:
        for k, e in self.entries.items():
            if k != keep:
                e.fields = {q for q in e.fields if not _overlaps(q, path)}

    def apply(self, live: dict[str, Any], config: dict[str, Any], manager: str,
              force: bool) -> dict[str, Any]:
        """The object after `manager` applies `config` (raises Conflict)."""
        key = (manager, "Apply", "")
        sent = managed(config)
        conflicts = sorted({(e.manager, q) for k, e in self.entries.items() if k != key
                            for q in e.fields for p, v in sent.items()
                            if _overlaps(p, q) and value_at(live, p) != v})
        if conflicts and not force:
            raise Conflict(conflicts)
        for _, q in conflicts:
            self._take(q, key)
        mine = self._entry(manager, "Apply", "", config.get("apiVersion", ""))
        new = copy.deepcopy(live)
        others = self.owned(exclude=key)
        for p in mine.fields - set(sent):
            if not any(_overlaps(p, q) for q in others):
                _remove(new, p, others | set(sent))
        for p, v in sent.items():
            _set(new, p, v)
        mine.fields = set(sent)
        self._drop_empty()
        return new

    def update(self, old: dict[str, Any], new: dict[str, Any], manager: str,
               subresource: str = "") -> None:
        """Record a non-apply write that turned `old` into `new`."""
        before, after = managed(old, subresource), managed(new, subresource)
        key = (manager, "Update", subresource)
        changed = {p for p, v in after.items() if before.get(p, _MISSING) != v}
        removed = set(before) - set(after)
        for p in removed:
            self._take(p, ("", "", ""))
        if changed:
            for p in changed:
                self._take(p, key)
            self._entry(manager, "Update", subresource, new.get("apiVersion", "")) \
                .fields |= changed
        self._drop_empty()

    def forget_unset(self, obj: dict[str, Any]) -> None:
        """Fields no longer in the object (a subresource reset them) leave every manager."""
        for e in self.entries.values():
            e.fields = {p for p in e.fields if value_at(obj, p) is not _MISSING}
        self._drop_empty()

    def _drop_empty(self) -> None:
        self.entries = {k: e for k, e in self.entries.items() if e.fields}

    def managed_fields(self) -> list[dict[str, Any]]:
        out = []
        for e in self.entries.values():
            entry = {"manager": e.manager, "operation": e.operation, "apiVersion": e.api_version,
                     "time": e.time, "fieldsType": "FieldsV1", "fieldsV1": _fields_v1(e.fields)}
            if e.subresource:
                entry["subresource"] = e.subresource
            out.append(entry)
        return out
