"""`kvyard bench slo`'s autoscale section: its flags, which comparison runs (the real stack,
`slo_autoscale_stack`, or with `--quick` the fluid model, `slo_autoscale`), and
`--only autoscale`, the section alone."""
from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

KEYS = ("attainment", "goodput", "pod_seconds")
FLUID_POD_START_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("autoscale (simulated seconds)")
    g.add_argument("--only", choices=("autoscale",), default=None,
                   help="run one section alone (autoscale: the real-stack comparison; with "
                        "--quick a short ramp)")
    g.add_argument("--autoscale-model", choices=("stack", "fluid"), default=None,
                   help="stack: pods started by the local autoscaler behind Envoy and the EPP "
                        "(default); fluid: the one-second fluid model (--quick's default)")
    g.add_argument("--autoscale-base", type=float, default=2.0, help="base rate, req/s")
    g.add_argument("--autoscale-max-pods", type=int, default=8)
    g.add_argument("--autoscale-time-scale", type=float, default=2.0,
                   help="the pods' --time-scale (simulated seconds per wall second)")
    g.add_argument("--autoscale-poll", type=float, default=10.0, help="KEDA's pollingInterval")
    g.add_argument("--autoscale-target", type=float, default=0.6, help="KEDA's targetValue")
    g.add_argument("--autoscale-lead", type=float, default=None,
                   help="the forecast's horizon (default: --pod-start)")


def settings(args: argparse.Namespace, quick: bool):
    from kvyard.bench.slo_autoscale_stack import POD_START_S, Settings
    from kvyard.bench.slo_autoscale_traffic import QUICK_RAMP, Ramp

    ramp = replace(QUICK_RAMP if quick else Ramp(), base_rps=args.autoscale_base)
    return Settings(ramp=ramp,
        max_pods=args.autoscale_max_pods,
        pod_start_s=POD_START_S if args.pod_start is None else args.pod_start,
        time_scale=args.autoscale_time_scale, polling_s=args.autoscale_poll,
        target=args.autoscale_target, lead_s=args.autoscale_lead, seed=args.seed)


def section(args: argparse.Namespace, root: Path) -> dict:
    """{"reactive": {...}, "predictive": {...}, "model": {...}} (and "spare" from the fluid
    model: its pods ready in a second)."""
    model = args.autoscale_model or ("fluid" if args.quick and not args.only else "stack")
    if model == "fluid":
        from kvyard.bench.slo_autoscale import compare

        out = compare(base=8.0, max_pods=args.pods,
                      start_s=FLUID_POD_START_S if args.pod_start is None else args.pod_start)
        out["model"] = {"kind": "fluid", **out["model"]}
        return out
    from kvyard.bench.slo_autoscale_stack import compare

    return compare(settings(args, args.quick), root / "autoscale")


def summary(auto: dict) -> dict:
    """The `--json` "autoscale" key: attainment, goodput and pod-seconds per mode."""
    return {m: {k: auto[m].get(k) for k in KEYS} for m in ("reactive", "predictive")}


def run_only(args: argparse.Namespace) -> int:
    from kvyard.bench.route import _finite

    root = Path(args.run_dir or tempfile.mkdtemp(prefix="kvyard-bench-slo-"))
    auto = section(args, root)
    doc = _finite({"autoscale": summary(auto), "autoscale_detail": auto})
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(table(auto).table())
    return 0


def table(auto: dict):
    from kvyard.bench.report import Report

    m = auto["model"]
    rep = Report(title=f"kvyard bench slo: autoscaling ({m['kind']} model, simulated seconds)",
                 columns=["mode", "attainment", "goodput", "pod_seconds", "peak_pods",
                          "ttft_p90", "errors"])
    for mode in ("reactive", "predictive"):
        r = auto[mode]
        rep.add(mode=mode, attainment=r["attainment"], goodput=r["goodput"],
                pod_seconds=r["pod_seconds"], peak_pods=r.get("peak_pods"),
                ttft_p90=r.get("ttft_p90"), errors=r.get("errors"))
    for mode in ("reactive", "predictive"):
        if "attainment_by_phase" in auto[mode]:
            rep.notes.append(f"{mode} by phase: {json.dumps(auto[mode]['attainment_by_phase'])}; "
                             f"events: {json.dumps(auto[mode].get('events'))}")
    rep.notes.append(f"model: {json.dumps(m)}")
    return rep
