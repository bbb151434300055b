"""`kvyard bench slo --repeat N`: the repeats' per-policy figures as medians with their
range. Each repeat runs every policy on the same requests back to back (paired), so a
policy's median over repeats is compared with the others' under the same conditions;
on a busy machine one run's top rung mostly tells whether the pool tipped into a queue
collapse, and the median with its min/max says how often.
"""
from __future__ import annotations

import math
import statistics

SPREAD = ("goodput", "att_interactive", "att_batch")  # reported with min and max


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else math.nan


def merge_rungs(reps: list[dict]) -> dict:
    """One rung's rows from every repeat -> its medians (+ min/max of the SPREAD keys)."""
    first = reps[0]
    out: dict = {"rate": first["rate"], "repeats": len(reps)}
    for k, v in first.items():
        if k in ("rate", "attainment") or not isinstance(v, (int, float)):
            continue
        out[k] = _median([r[k] for r in reps])
    out["attainment"] = {c: _median([r["attainment"][c] for r in reps])
                         for c in first["attainment"]}
    for key in SPREAD:
        vals = [r["goodput"] if key == "goodput" else r["attainment"][key.split("_", 1)[1]]
                for r in reps]
        out[f"{key}_min"], out[f"{key}_max"] = min(vals), max(vals)
    return out


def merge_policy(runs: list[list[dict]]) -> list[dict]:
    """A policy's rungs over repeats (runs[repeat][rung]) -> per-rung medians."""
    return [merge_rungs([run[i] for run in runs]) for i in range(len(runs[0]))]


def merge_predictor(snaps: list[dict]) -> dict:
    """The held-out predictor errors of each repeat -> their medians."""
    out: dict = {}
    for kind in ("ttft", "tpot"):
        ks = [s.get(kind, {}) for s in snaps if s.get(kind, {}).get("samples")]
        if ks:
            out[kind] = {"samples": sum(k["samples"] for k in ks),
                         "mape": _median([k["mape"] for k in ks]),
                         "p90_coverage": _median([k["p90_coverage"] for k in ks])}
    ol = [s["output_len"] for s in snaps if s.get("output_len", {}).get("samples")]
    if ol:
        out["output_len"] = {"samples": sum(o["samples"] for o in ol),
                             "mae": _median([o["mae"] for o in ol]),
                             "mae_baseline": _median([o["mae_baseline"] for o in ol])}
    return out
