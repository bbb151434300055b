"""`kvyard bench epp`: what the EPP costs, measured against the path without it.

Two parts, one run:

1. Decision latency: `kvyard.bench.epp_api.decision_latency` (in-process:
   `Director.handle` as `kvyard epp` runs it: parse, tokenize, hash,
   admission, score, pick) for 8/64/256 endpoints x 1k/8k/50k token prompts. Targets: p99 <= 2 ms at 64 endpoints with 8k prompts; a 50k
   prompt adds <= 25 ms over a 1k one.
2. Gateway throughput: requests/s through Envoy -> EPP (one process) -> a
   stand-in worker, against Envoy routing straight to the same stand-in. Both
   paths get the same load generator (`kvyard.bench.loadgen`, raw asyncio
   HTTP/1.1 in its own process so the client never shares an interpreter with
   the measured parts), the same concurrency and the same duration. Target:
   >= 1,000 req/s through one EPP process. Envoy runs with one worker thread.

Ratios are printed because the machine is shared and absolute numbers drift.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvyard.bench.report import Report, percentile

ENDPOINTS = (8, 64, 256)
PROMPTS = (1000, 8000, 50000)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")
    p.add_argument("--iterations", type=int, default=200, help="decisions per cell (part 1)")
    p.add_argument("--endpoints", type=int, nargs="+", default=list(ENDPOINTS))
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=list(PROMPTS))
    p.add_argument("--duration", type=float, default=5.0, help="seconds per path (part 2)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-chars", type=int, default=2000, help="request size (part 2)")
    p.add_argument("--model", default="demo", help="the EPP's tokenizer (part 2)")
    p.add_argument("--no-flow-control", action="store_true",
                   help="part 1: time the director as `kvyard epp --no-flow-control` runs it "
                        "(saturation shedding as its only admission)")
    p.add_argument("--skip-decision", action="store_true")
    p.add_argument("--skip-gateway", action="store_true")


def decision_rows(rep: Report, endpoints: list[int], prompts: list[int], iterations: int,
                  flow_control: bool = True) -> bool:
    """False (with a note saying why) when the EPP's bench API is unavailable."""
    try:
        from kvyard.bench.epp_api import decision_latency
    except ImportError as e:
        rep.notes.append(f"part 1 FAILED: kvyard.bench.epp_api.decision_latency is missing ({e})")
        return False
    p99: dict[tuple[int, int], float] = {}
    for n in endpoints:
        for t in prompts:
            lat = decision_latency(n, t, max(1, iterations if t < 20000 else iterations // 4),
                                   flow_control=flow_control)
            ms = [1000 * x for x in lat]
            p99[(n, t)] = percentile(ms, 99)
            rep.add(part="decision", endpoints=n, prompt_tokens=t, p50_ms=percentile(ms, 50),
                    p99_ms=p99[(n, t)], samples=len(ms))
    if (64, 8000) in p99:
        v = p99[(64, 8000)]
        rep.notes.append(f"decision p99 @64 endpoints, 8k tokens: {v:.2f} ms "
                         f"(target <= 2 ms: {'met' if v <= 2 else 'MISSED'})")
    if (64, 50000) in p99 and (64, 1000) in p99:
        add = p99[(64, 50000)] - p99[(64, 1000)]
        rep.notes.append(f"50k prompt adds {add:.1f} ms p99 over 1k @64 endpoints "
                         f"(target <= 25 ms: {'met' if add <= 25 else 'MISSED'})")
    return True


def _load(url: str, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvyard.bench.loadgen", "--url", url,
                          "--concurrency", str(args.concurrency), "--duration", str(args.duration),
                          "--prompt-chars", str(args.prompt_chars)],
                         check=True, capture_output=True, text=True,
                         timeout=args.duration + 60)
    return json.loads(out.stdout)


def gateway_rows(rep: Report, args: argparse.Namespace) -> None:
    from kvyard.gateway.config import GatewayConfig
    from kvyard.gateway.envoy import envoy_command, write_config
    from kvyard.stack import procs
    from kvyard.stack.commands import epp_cmd, py_module
    from kvyard.stack.endpoints_file import write_endpoints
    from kvyard.stack.readiness import epp_sees

    with tempfile.TemporaryDirectory(prefix="kvyard-bench-epp-") as tmp:
        run = Path(tmp)
        taken: set[int] = set()
        port = procs.free_port(None, taken)
        addr = f"127.0.0.1:{port}"
        eports = tuple(procs.free_port(None, taken) for _ in range(3))
        via_port, via_admin, direct_port, direct_admin = (procs.free_port(None, taken)
                                                          for _ in range(4))
        started: list[procs.Proc] = []
        try:
            w = procs.spawn("standin", py_module("kvyard.stack.standin", "--port", str(port)),
                            run / "standin.log")
            started.append(w)
            epp = procs.spawn("epp", epp_cmd(args.model, eports,
                                             write_endpoints(run / "endpoints.yaml", [addr])),
                              run / "epp.log")
            started.append(epp)
            via = GatewayConfig(listen_port=via_port, admin_port=via_admin,
                                epp_address=f"127.0.0.1:{eports[0]}")
            direct = GatewayConfig(listen_port=direct_port, admin_port=direct_admin,
                                   direct_upstream=addr)
            envoys = []
            for name, cfg in (("envoy-epp", via), ("envoy-direct", direct)):
                conf = write_config(cfg, run / f"{name}.yaml")
                envoys.append(procs.spawn(name, envoy_command(conf, concurrency=1),
                                          run / f"{name}.log"))
            started += envoys
            procs.wait_ready([(w, lambda: procs.http_ok(f"http://{addr}/health")),
                              (epp, epp_sees(f"http://127.0.0.1:{eports[2]}", 1)),
                              (envoys[0], lambda: procs.http_ok(f"http://127.0.0.1:{via_admin}/ready")),
                              (envoys[1], lambda: procs.http_ok(f"http://127.0.0.1:{direct_admin}/ready"))],
                             120.0)
            results = {}
            for name, url in (("envoy -> stand-in", f"http://127.0.0.1:{direct_port}"),
                              ("envoy -> EPP -> stand-in", f"http://127.0.0.1:{via_port}")):
                cpu0 = {p.name: procs.cpu_seconds(p.pid) for p in started}
                r = _load(url, args)
                cpu = {p.name: procs.cpu_seconds(p.pid) - cpu0[p.name] for p in started}
                n = max(1, r["total_answered"])
                r["epp_cpu_ms"] = 1000 * cpu["epp"] / n if "EPP" in name else 0.0
                r["envoy_cpu_ms"] = 1000 * (cpu["envoy-epp"] + cpu["envoy-direct"]) / n
                r["all_cpu_ms"] = 1000 * (sum(cpu.values()) + r["cpu_s"]) / n
                results[name] = r
                if r["errors"]:
                    rep.notes.append(f"{name}: {r['errors']} errors, statuses {r['statuses']} "
                                     f"(logs were in {run})")
                rep.add(part="gateway", path=name, concurrency=args.concurrency,
                        req_per_s=r["rps"], p50_ms=r["p50_ms"], p99_ms=r["p99_ms"],
                        epp_cpu_ms_per_req=r["epp_cpu_ms"] or None,
                        envoy_cpu_ms_per_req=r["envoy_cpu_ms"], errors=r["errors"])
        finally:
            procs.stop([p.pid for p in reversed(started)])
    base, epp_r = results["envoy -> stand-in"], results["envoy -> EPP -> stand-in"]
    ratio = epp_r["rps"] / base["rps"] if base["rps"] else float("nan")
    rep.notes.append(f"gateway req/s with EPP / without: {ratio:.2f}x "
                     f"({epp_r['rps']:.0f} vs {base['rps']:.0f}); target >= 1000 req/s through "
                     f"one EPP process: {'met' if epp_r['rps'] >= 1000 else 'MISSED'}")
    rep.notes.append(f"added p50 latency: {epp_r['p50_ms'] - base['p50_ms']:.2f} ms at "
                     f"concurrency {args.concurrency}")
    cores = os.cpu_count() or 1
    rep.notes.append(f"all processes (client, Envoy, EPP, stand-in) used {epp_r['all_cpu_ms']:.2f} ms "
                     f"CPU per request through the EPP ({base['all_cpu_ms']:.2f} without): on "
                     f"{cores} core(s) this machine alone caps the EPP path near "
                     f"{1000 * cores / epp_r['all_cpu_ms']:.0f} req/s")
    if epp_r["epp_cpu_ms"]:
        per_core = 1000 / epp_r["epp_cpu_ms"]
        rep.notes.append(f"EPP CPU per request: {epp_r['epp_cpu_ms']:.3f} ms -> {per_core:.0f} req/s "
                         f"per fully used core (target >= 1000: {'met' if per_core >= 1000 else 'MISSED'}; "
                         "less sensitive to a shared machine than wall-clock req/s)")


def run(args: argparse.Namespace) -> int:
    rep = Report(title="kvyard bench epp",
                 columns=["part", "endpoints", "prompt_tokens", "path", "concurrency",
                          "req_per_s", "p50_ms", "p99_ms", "epp_cpu_ms_per_req",
                          "envoy_cpu_ms_per_req", "samples", "errors"])
    rep.meta.update({"duration_s": args.duration, "concurrency": args.concurrency,
                     "loadgen": "kvyard.bench.loadgen (own process, raw asyncio HTTP/1.1)",
                     "envoy_concurrency": 1})
    ok = True
    if not args.skip_decision:
        ok = decision_rows(rep, args.endpoints, args.prompt_tokens, args.iterations,
                           not args.no_flow_control)
    if not args.skip_gateway:
        gateway_rows(rep, args)
    rep.emit(args.json)
    return 0 if ok else 1
