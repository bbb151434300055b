"""The EPP policies `kvyard bench route` compares, as scheduler configs built from
the plugins the EPP registers (`epp/scheduling/registry.py`).

A policy the registry cannot express is listed with the reason it is unavailable,
so the report still names it. The configs are JSON, which the EPP's YAML loader
reads as is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.epp.scheduling.registry import PICKERS, SCORERS

FILTERS = ["healthy", "prefer-fresh", "role"]
PICKER = {"type": "max-score", "maxEndpoints": 1}
LOAD = [{"type": "queue", "weight": 2}, {"type": "kv-cache-utilization", "weight": 2}]


@dataclass(slots=True)
class Policy:
    name: str
    scorers: list[dict] = field(default_factory=list)
    unavailable: str | None = None
    epp_args: list[str] = field(default_factory=list)
    picker: dict = field(default_factory=lambda: dict(PICKER))
    replicas: int = 1  # EPPs sharing their picks behind the one Envoy (kvyard up's)

    def config(self) -> dict:
        return {"profileHandler": {"type": "single-profile"},
                "profiles": {"default": {"filters": FILTERS, "scorers": self.scorers,
                                         "picker": self.picker}}}

    def write(self, run: Path) -> Path:
        path = run / f"scheduler-{self.name}.yaml"
        path.write_text(json.dumps(self.config(), indent=1))
        return path


def _precise_scorer() -> str | None:
    """The registry's precise prefix-cache scorer, if this build has one."""
    return next((k for k in SCORERS if "precise" in k), None)


def policies() -> list[Policy]:
    precise = _precise_scorer()
    needs = None if precise else "unavailable (needs the precise-prefix-cache scorer)"
    scored = [{"type": precise, "weight": 3}, *LOAD] if precise else []
    rr = "round-robin" in PICKERS
    return [
        # No scorer: every total is 0 and max-score picks uniformly among the ties.
        Policy("random"),
        # No scorer, every endpoint tied: the round-robin picker takes them in turn.
        Policy("round_robin", picker={**PICKER, "type": "round-robin"},
               unavailable=None if rr else "unavailable (no round-robin picker)"),
        Policy("load", list(LOAD)),
        Policy("approx_prefix", [{"type": "prefix-cache", "weight": 3}, *LOAD]),
        Policy("precise_prefix", list(scored), unavailable=needs),
        Policy("precise_prefix_x2", list(scored), unavailable=needs, replicas=2),
        Policy("precise_prefix_x4", list(scored), unavailable=needs, replicas=4),
    ]


def select(names: list[str] | None) -> list[Policy]:
    """None: every policy; [] none."""
    every = policies()
    if names is None:
        return every
    known = {p.name: p for p in every}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]
