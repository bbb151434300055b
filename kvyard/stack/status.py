"""`kvyard status`: what the EPP currently believes about each endpoint, each
worker's kvstore tiers, and the supervisor.

Routing columns come from the EPP's `/debug/endpoints`, not the workers, because
routing decisions are made on the EPP's view (scrape age and all). The kvstore
column comes from each worker's own `/metrics` (`kvyard:kvstore_tier_up`,
`kvyard:kvstore_errors_total`): only the worker knows whether its Redis answers.
So does the handoffs column (P/D: `kvyard:pd_handoffs_total{path}`, fallbacks,
refused prefill targets), counted where the KV arrives, on decode workers.
The scaler line is what KEDA sees: the EPP's external scaler (its port from
`/debug/endpoints`), asked over gRPC exactly as KEDA asks it (`IsActive`,
`GetMetricSpec`, `GetMetrics`), once per role the stack runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from kvyard.stack.rundir import add_run_dir, run_dir

COLUMNS = ("address", "role", "queue", "kv_usage", "picks", "prefix_hits")
# The EPP's own names for the same things, if it uses different ones.
ALIASES = {"queue": ("queue", "waiting", "num_requests_waiting"),
           "kv_usage": ("kv_usage", "kv_cache_usage", "kv_cache_usage_perc")}
TIER_UP = "kvyard:kvstore_tier_up"
TIER_ERRORS = "kvyard:kvstore_errors_total"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_run_dir(p)


def normalise(row: dict) -> dict:
    out = {}
    for c in COLUMNS:
        out[c] = next((row[k] for k in ALIASES.get(c, (c,)) if k in row), None)
    return out


def kvstore_tiers(metrics_text: str) -> dict[str, dict]:
    """{tier: {"up": bool, "errors": int}} from a worker's Prometheus text; {} for a
    worker without a kvstore."""
    from prometheus_client.parser import text_string_to_metric_families

    tiers: dict[str, dict] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            tier = s.labels.get("tier")
            if tier is None:
                continue
            if s.name == TIER_UP:
                tiers.setdefault(tier, {"up": True, "errors": 0})["up"] = s.value >= 1
            elif s.name == TIER_ERRORS:
                tiers.setdefault(tier, {"up": True, "errors": 0})["errors"] = int(s.value)
    return tiers


def pd_counts(metrics_text: str) -> dict | None:
    """{"handoffs": {path: n}, "fallbacks": {reason: n}, "rejected": n} from a worker's
    P/D counters (kvyard.common.wire); None for a worker without them."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvyard.common import wire

    out: dict = {"handoffs": {}, "fallbacks": {}, "rejected": 0}
    seen = False
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == wire.M_PD_HANDOFFS:
                out["handoffs"][s.labels.get("path", "")] = int(s.value)
            elif s.name == wire.M_PD_FALLBACKS:
                if s.value:
                    out["fallbacks"][s.labels.get("reason", "")] = int(s.value)
            elif s.name == wire.M_PD_REJECTED:
                out["rejected"] = int(s.value)
            else:
                continue
            seen = True
    return out if seen else None


def worker_view(address: str) -> tuple[dict[str, dict] | None, dict | None]:
    """The worker's kvstore tiers and P/D counts; (None, None) when its /metrics does
    not answer."""
    from kvyard.stack import procs

    try:
        code, body = procs.http_get(f"http://{address}/metrics", 2.0)
        if code != 200:
            return None, None
        text = body.decode()
        return kvstore_tiers(text), pd_counts(text)
    except (OSError, ValueError):
        return None, None


def worker_kvstore(address: str) -> dict[str, dict] | None:
    """The worker's tiers, or None when its /metrics does not answer."""
    return worker_view(address)[0]


def fmt_pd(pd: dict | None) -> str:
    if not pd:
        return "-"
    cells = [f"{p}:{n}" for p, n in pd["handoffs"].items() if n]
    fb = sum(pd["fallbacks"].values())
    if fb:
        cells.append(f"fallbacks:{fb}")
    if pd["rejected"]:
        cells.append(f"rejected:{pd['rejected']}")
    return " ".join(cells) or "0"


def fmt_kvstore(tiers: dict[str, dict] | None) -> str:
    if tiers is None:
        return "unreachable"
    if not tiers:
        return "-"
    cells = []
    for name, t in tiers.items():
        errors = t["errors"]
        cells.append(f"{name}:{'up' if t['up'] else 'down'}"
                     + (f"({errors} error{'' if errors == 1 else 's'})" if errors else ""))
    return " ".join(cells)


def stack_roles(spec: dict) -> list[str]:
    """The worker roles a stack runs (its ScaledObjects), from the state's spec."""
    if spec.get("prefill") or spec.get("decode"):
        return ["prefill", "decode"]
    return ["both"]


def scaler_view(address: str, pool: str, roles: list[str], timeout: float = 2.0) -> dict:
    """{"address", "pools": [{pool, role, metadata, active, metric, target}]}, asked as KEDA
    asks; a role the scaler refuses carries "error" instead of the readings."""
    import grpc

    from kvyard.common import keda

    pb2 = keda.pb2
    pools = []
    with grpc.insecure_channel(address) as ch:
        stub = keda.pb2_grpc.ExternalScalerStub(ch)
        for role in roles:
            meta = {"pool": pool, "role": role}
            ref = pb2.ScaledObjectRef(name=f"kvyard-{role}", namespace="local",
                                      scalerMetadata=meta)
            row: dict = {"pool": pool, "role": role, "metadata": meta}
            try:
                spec = stub.GetMetricSpec(ref, timeout=timeout).metricSpecs[0]
                got = stub.GetMetrics(pb2.GetMetricsRequest(
                    scaledObjectRef=ref, metricName=spec.metricName), timeout=timeout)
                row.update(active=stub.IsActive(ref, timeout=timeout).result,
                           metric=got.metricValues[0].metricValueFloat,
                           target=spec.targetSizeFloat or float(spec.targetSize))
            except grpc.RpcError as e:
                row.update(active=None, metric=None, error=f"{e.code().name}: {e.details()}")
            pools.append(row)
    return {"address": address, "pools": pools}


def epp_scaler(doc: object, epp_metrics_url: str, roles: list[str]) -> dict | None:
    """The scaler the EPP reports in /debug/endpoints, queried; None if it serves none."""
    from urllib.parse import urlparse

    info = doc.get("scaler") if isinstance(doc, dict) else None
    if not isinstance(info, dict) or not info.get("port"):
        return None
    host = urlparse(epp_metrics_url).hostname or "127.0.0.1"
    return scaler_view(f"{host}:{info['port']}", str(info.get("pool", "default")), roles)


def fmt_scaler(sc: dict | None) -> str:
    if sc is None:
        return "scaler: not served by this EPP"
    cells = []
    for p in sc["pools"]:
        if "error" in p:
            cells.append(f"{p['role']} error ({p['error']})")
        else:
            cells.append(f"{p['role']} {'active' if p['active'] else 'idle'} "
                         f"metric {p['metric']:.2f} (target {_fmt(p['target'])})")
    pool = sc["pools"][0]["pool"] if sc["pools"] else "-"
    return f"scaler: {sc['address']} pool {pool}: " + ", ".join(cells)


def supervisor_view(state) -> dict:
    """Whether `kvyard up`'s supervisor runs, and how often it restarted what."""
    from kvyard.stack import procs

    sup = state.supervisor
    return {"running": bool(sup and procs.is_ours(sup)), "pid": sup.pid if sup else None,
            "restarts": {p.name: {"count": p.restarts, "last_exit": p.last_exit}
                         for p in state.procs if p.restarts}}


def autoscaler_view(state, epp_doc: object = None) -> dict | None:
    """`kvyard up --scale-to-zero`'s autoscaler: the workers running against what it wants,
    what it last saw (autoscale.json), whether it runs, and the requests the EPP holds
    meanwhile (/debug/endpoints' flow entry); None without scale to zero."""
    if not state.scaling:
        return None
    from pathlib import Path

    from kvyard.stack import autoscale, procs, resize

    doc = autoscale.read_file(Path(state.run_dir)) or {}
    proc = next((p for p in state.procs if p.name == "autoscaler"), None)
    pools = doc.get("pools") or [{}]
    flow = (epp_doc.get("flow") if isinstance(epp_doc, dict) else None) or {}
    from kvyard.stack import prestart

    spares = [p for p in state.procs if p.name == resize.SPARE and procs.is_ours(p)]
    return {"running": bool(proc and procs.is_ours(proc)),
            "spare": None if not spares else "ready" if prestart.ready_file(
                Path(state.run_dir), spares[0].pid).exists() else "importing",
            "parked": flow.get("parked"), "oldest_wait_s": flow.get("oldest_wait_s"),
            "workers": sum(1 for p in state.procs if resize.is_worker(p)),
            "streams": doc.get("streams", {}), "pushes": doc.get("pushes", 0),
            "last_error": doc.get("last_error", ""), **{k: pools[0].get(k) for k in (
                "pool", "role", "replicas", "min", "max", "active", "metric", "reason",
                "idle_s", "cooldown_s")}}


def fmt_autoscaler(a: dict | None) -> str | None:
    if a is None:
        return None
    if not a["running"]:
        return f"autoscaler: not running; workers {a['workers']}"
    at_zero = " (scaled to zero: a request starts one)" if a["workers"] == 0 else ""
    if a["parked"]:
        at_zero += f", {a['parked']} request(s) parked (oldest {a['oldest_wait_s']:g}s)"
    idle = "" if a["idle_s"] is None else f", idle {a['idle_s']:g}s of {a['cooldown_s']:g}s"
    streams = ", ".join(f"{k} {v}" for k, v in a["streams"].items()) or "none"
    if a["spare"]:
        at_zero += f", spare interpreter {a['spare']}"
    return (f"autoscaler: workers {a['workers']}{at_zero}, wants {a['replicas']} "
            f"[{a['min']}..{a['max']}] ({a['reason']}{idle}); stream {streams}; "
            f"wake-ups {a['pushes']}")


def run(args: argparse.Namespace) -> int:
    from kvyard.stack import procs
    from kvyard.stack.endpoints_file import parse_endpoints
    from kvyard.stack.state import StackState

    rd = run_dir(args)
    state = StackState.load(rd)
    if state is None or not state.gateway_url:
        print(f"kvyard: no stack in {rd} (start one with `kvyard up`)", file=sys.stderr)
        return 1
    try:
        code, body = procs.http_get(state.epp_metrics_url + "/debug/endpoints", 2.0)
        doc = json.loads(body) if code == 200 else None
        rows = [normalise(r) for r in parse_endpoints(doc)] if code == 200 else None
    except (OSError, ValueError):
        doc = rows = None
    if rows is None:
        print(f"kvyard: the EPP at {state.epp_metrics_url} does not answer; "
              "see its log, or restart with `kvyard up --restart`", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(min(8, max(1, len(rows)))) as pool:
        for r, (kv, pd) in zip(rows, pool.map(worker_view, [r["address"] for r in rows])):
            r["kvstore"] = kv
            r["pd"] = pd
    from kvyard.stack.sim_pool import sim_view

    sim = sim_view(state)  # the simulated pods' processes (rows keep the workers' columns)
    sup = supervisor_view(state)
    scaler = epp_scaler(doc, state.epp_metrics_url, stack_roles(state.spec))
    auto = autoscaler_view(state, doc)
    from kvyard.stack.epp_replicas import epps_view, fmt_epps

    epps = epps_view(state)
    if args.json:
        print(json.dumps({"gateway": state.gateway_url, "endpoints": rows, "supervisor": sup,
                          "scaler": scaler, "autoscaler": auto, "flow": doc.get("flow"),
                          "sim": sim, "epps": epps},
                         indent=2))
        return 0
    print(f"gateway: {state.gateway_url}")
    cols = (*COLUMNS, "kvstore", "handoffs")
    cells = [[_fmt(r[c]) for c in COLUMNS] + [fmt_kvstore(r["kvstore"]), fmt_pd(r["pd"])]
             for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip())
    print(_fmt_supervisor(sup))
    if len(epps) > 1:
        print(fmt_epps(epps))
    if sim is not None:
        print(f"simulated: {sim['pods']} pods (profile {sim['profile']}) in "
              f"{len(sim['processes'])} process(es)")
    flow = doc.get("flow")
    if flow:
        print(f"flow control: {flow['parked']} parked (no ready endpoint), {flow['queued']} "
              f"queued (saturated), {flow['bytes']} bytes held")
    print(fmt_scaler(scaler))
    if auto is not None:
        print(fmt_autoscaler(auto))
    return 0


def _fmt_supervisor(sup: dict) -> str:
    if not sup["running"]:
        return "supervisor: not running (nothing restarts what dies; `kvyard up --restart`)"
    restarts = ", ".join(f"{n} {r['count']}x (last: {r['last_exit']})"
                         for n, r in sup["restarts"].items()) or "none"
    return f"supervisor: running (pid {sup['pid']}); restarts: {restarts}"


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) >= 1 or v == 0 else f"{v:.2f}"
    return "-" if v is None else str(v)
