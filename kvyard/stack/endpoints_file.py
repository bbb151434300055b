"""The EPP's endpoints file, as the local stack writes it, and its /debug/endpoints
rows, as the stack reads them back."""
from __future__ import annotations

from pathlib import Path


def write_endpoints(path: Path, addresses: list[str], role: str | list[str] = "both",
                    pools: list[str] | None = None,
                    kv_events: dict[str, tuple[str, str]] | None = None) -> Path:
    """The EPP's endpoints file (`role`: one for all, or one per address; `pools`: each
    address's pool, several models behind one EPP; `kv_events`: an address's KV-event PUB
    and replay endpoints); the EPP reloads it on change. Written atomically."""
    import yaml

    roles = [role] * len(addresses) if isinstance(role, str) else list(role)
    if len(roles) != len(addresses):
        raise ValueError(f"{len(addresses)} addresses but {len(roles)} roles")
    rows = []
    for a, r in zip(addresses, roles):
        row = {"address": a, "role": r}
        if kv_events and a in kv_events:
            row["kv_events"], row["kv_events_replay"] = kv_events[a]
        rows.append(row)
    for row, pool in zip(rows, pools or []):
        row["pool"] = pool
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(rows))
    tmp.replace(path)
    return path


def parse_endpoints(doc: object) -> list[dict]:
    """The EPP's /debug/endpoints rows, whether it answers a list or {"endpoints": [...]}."""
    rows = doc.get("endpoints", []) if isinstance(doc, dict) else doc
    return [r for r in rows or [] if isinstance(r, dict)]
