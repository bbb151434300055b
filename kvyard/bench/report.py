"""Tables and JSON for benchmark results, shared by every `kvyard bench`."""
from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in 0..100), interpolated linearly between the two nearest
    ranks as numpy.percentile does by default (and vLLM's `bench serve`); nan for no
    data. Every bench's percentiles are this one."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = max(0, min(len(s) - 1, math.floor(pos)))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(slots=True)
class Report:
    """Rows of dicts with the same keys, plus notes (targets, ratios, verdicts)."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, **row: Any) -> None:
        self.rows.append(row)

    def to_json(self) -> dict[str, Any]:
        meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "python": sys.version.split()[0], "machine": platform.machine(), **self.meta}
        return {"title": self.title, "rows": self.rows, "notes": self.notes, "meta": meta}

    def table(self) -> str:
        def fmt(v: Any) -> str:
            if isinstance(v, float):
                if math.isnan(v):
                    return "-"
                return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
            return "-" if v is None else str(v)

        cells = [[fmt(r.get(c)) for c in self.columns] for r in self.rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.columns)]
        line = "  ".join(c.ljust(w) for c, w in zip(self.columns, widths))
        out = [self.title, line, "  ".join("-" * w for w in widths)]
        out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
        out += self.notes
        return "\n".join(out)

    def emit(self, as_json: bool) -> None:
        print(json.dumps(self.to_json(), indent=2) if as_json else self.table(), flush=True)
