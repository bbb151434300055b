"""A running stack's record (`state.json` in the run dir): what `down`, `status`, the
supervisor and the benches read back."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.stack.procs import Proc

STATE_FILE = "state.json"


@dataclass(slots=True)
class StackState:
    """What `down` and `status` need, persisted as JSON in the run dir."""

    run_dir: str
    gateway_url: str
    admin_url: str
    epp_metrics_url: str
    endpoints: list[str]
    procs: list[Proc]
    spec: dict = field(default_factory=dict)
    # `kvyard up`'s supervisor (kvyard.stack.supervise), which restarts what dies
    supervisor: Proc | None = None
    # scale to zero: the scaled pool (kvyard.stack.resize.Pool.to_json), else None
    scaling: dict | None = None

    def save(self) -> None:
        data = {"run_dir": self.run_dir, "gateway_url": self.gateway_url,
                "admin_url": self.admin_url, "epp_metrics_url": self.epp_metrics_url,
                "endpoints": self.endpoints, "procs": [p.to_json() for p in self.procs],
                "spec": self.spec,
                "supervisor": self.supervisor.to_json() if self.supervisor else None,
                "scaling": self.scaling}
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)  # atomic: `down` never reads half a file

    @classmethod
    def load(cls, run_dir: Path) -> "StackState | None":
        try:
            d = json.loads((run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        sup = d.get("supervisor")
        return cls(run_dir=d["run_dir"], gateway_url=d["gateway_url"], admin_url=d["admin_url"],
                   epp_metrics_url=d["epp_metrics_url"], endpoints=d["endpoints"],
                   procs=[Proc(**p) for p in d["procs"]], spec=d.get("spec", {}),
                   supervisor=Proc(**sup) if sup else None, scaling=d.get("scaling"))

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
