"""`kvyard status`: what the EPP currently believes about each endpoint.

It reads the EPP's `/debug/endpoints`, not the workers, because routing
decisions are made on the EPP's view (scrape age and all).
"""
from __future__ import annotations

import argparse
import json
import sys

from kvyard.stack.rundir import add_run_dir, run_dir

COLUMNS = ("address", "role", "queue", "kv_usage", "picks", "prefix_hits")
# The EPP's own names for the same things, if it uses different ones.
ALIASES = {"queue": ("queue", "waiting", "num_requests_waiting"),
           "kv_usage": ("kv_usage", "kv_cache_usage", "kv_cache_usage_perc")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_run_dir(p)


def normalise(row: dict) -> dict:
    out = {}
    for c in COLUMNS:
        out[c] = next((row[k] for k in ALIASES.get(c, (c,)) if k in row), None)
    return out


def run(args: argparse.Namespace) -> int:
    from kvyard.stack import procs
    from kvyard.stack.launch import StackState, parse_endpoints

    rd = run_dir(args)
    state = StackState.load(rd)
    if state is None or not state.gateway_url:
        print(f"kvyard: no stack in {rd} (start one with `kvyard up`)", file=sys.stderr)
        return 1
    try:
        code, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints", 2.0)
        rows = [normalise(r) for r in parse_endpoints(json.loads(body))] if code == 200 else None
    except (OSError, ValueError):
        rows = None
    if rows is None:
        print(f"kvyard: the EPP at {state.epp_metrics_url} does not answer; "
              "see its log, or restart with `kvyard up --restart`", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"gateway": state.gateway_url, "endpoints": rows}, indent=2))
        return 0
    print(f"gateway: {state.gateway_url}")
    cells = [[_fmt(r[c]) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))
    return 0


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) >= 1 or v == 0 else f"{v:.2f}"
    return "-" if v is None else str(v)
