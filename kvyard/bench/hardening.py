"""`kvyard bench hardening`: what hostile input and a long soak cost the stack.

One run, each number beside its baseline from the same run:

1. Stop strings: a normal short completion's latency while another client sends
   20,000 stop strings of ~55 characters (refused with a 400) or the cap, 128
   of 512 (served), against the same request alone, in interleaved pairs
   (median ratio; target <= 1.5). The control is a concurrent request without
   stop strings, since a batch of two costs something by itself.
2. Rejection cost: the worker's CPU time to refuse a 10 MB body (target
   <= 50 ms), a 4 MB one-prompt body and the 20,000 stop strings, beside a
   12-byte bad body.
3. Bad input: the corpus of `bad_inputs.py` through the gateway and at the
   worker directly: answers that are 5xx (target 0) or not OpenAI-shaped.
4. Redis under a soak (`--soak-seconds`, 0 skips it): unique ~2k-token prompts
   through `kvyard up --kv-redis`; Redis's memory against its cap (target: at
   most the cap) and the bytes the workers wrote.

The stack (Envoy, EPP, one real float32 worker on the demo model) is started
for parts 1-3 and stopped after; the soak starts its own.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvyard.bench.report import Report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")
    p.add_argument("--pairs", type=int, default=5, help="paired runs per latency/CPU row")
    p.add_argument("--soak-seconds", type=float, default=300.0,
                   help="Redis soak length (0: skip it)")
    p.add_argument("--soak-max-memory", default="1GiB")


def _stack(run_dir: Path):
    from kvyard.stack.launch import start_stack
    from kvyard.stack.spec import StackSpec

    return start_stack(StackSpec(run_dir=run_dir, workers=1, gateway_port=None,
                                 worker_base_port=None, epp_ports=(None, None, None),
                                 admin_port=None, scaler_port=None, dtype="float32", kv_tiers=False,
                                 ready_timeout_s=600.0))


def corpus_rows(rep: Report, urls: dict[str, str]) -> None:
    from kvyard.bench.bad_inputs import run_corpus

    for where, url in urls.items():
        answers = run_corpus(url)
        fivexx = [a.case for a in answers if a.status >= 500 or a.status == 0]
        shapeless = [a.case for a in answers if a.error is None]
        rep.add(check=f"bad input via {where}: 5xx or no answer", value=len(fivexx),
                baseline=len(answers), unit="of cases", target="0")
        rep.add(check=f"bad input via {where}: not OpenAI-shaped", value=len(shapeless),
                baseline=len(answers), unit="of cases", target="0")
        if fivexx or shapeless:
            rep.notes.append(f"{where}: 5xx {fivexx}; not OpenAI-shaped {shapeless}")


def limit_rows(rep: Report, url: str, pid: int, pairs: int) -> None:
    from kvyard.bench.worker_limits import measure, reject_cpu

    m = measure(url, pid, pairs=pairs)
    control = m["no_stops"]["median_ratio"]
    for key, label in (("no_stops", "normal request beside one without stops (control)"),
                       ("stop_20000x55", "normal request beside 20,000 stop strings"),
                       ("stop_20000x55_back_to_back", "... sent back to back"),
                       ("stop_128x512", "normal request beside the cap, 128 x 512"),
                       ("stop_128x512_back_to_back", "... sent back to back")):
        r = m[key]
        rep.add(check=label, value=round(r["median_ratio"], 3), baseline=round(control, 3),
                unit="x alone", target="<= 1.5" if key != "no_stops" else "-",
                statuses=r["stop_statuses"])
    tiny = reject_cpu(url, pid, b'{"prompt": x', pairs)
    for key, label in (("reject_10MB_body", "CPU to refuse a 10 MB body"),
                       ("reject_4MB_prompt", "CPU to refuse a 4 MB one-prompt body"),
                       ("reject_20000_stops", "CPU to refuse 20,000 stop strings")):
        r = m[key]
        rep.add(check=label, value=round(r["median_cpu_ms"], 1),
                baseline=round(tiny["median_cpu_ms"], 1), unit="ms (baseline: a 12-byte bad body)",
                target="<= 50" if key == "reject_10MB_body" else "-", statuses=r["statuses"])


def soak_rows(rep: Report, seconds: float, max_memory: str) -> None:
    from kvyard.bench.redis_soak import soak

    s = soak(seconds=seconds, max_memory=max_memory)
    final = s["final"]
    rep.add(check=f"Redis used_memory after a {seconds:g} s soak", value=final["used_memory"],
            baseline=s["cap_bytes"], unit="bytes (baseline: the cap)", target="<= cap")
    rep.add(check="bytes the workers wrote to Redis", value=s["written_to_redis_bytes"],
            baseline=s["cap_bytes"], unit="bytes", target="-")
    rep.add(check="soak requests failed", value=s["errors"], baseline=s["requests"],
            unit="of requests", target="0")
    rep.meta["soak"] = s


def run(args: argparse.Namespace) -> int:
    from kvyard.stack.launch import stop_stack

    rep = Report("kvyard bench hardening", ["check", "value", "baseline", "unit", "target"])
    state = _stack(Path(tempfile.mkdtemp(prefix="kvyard-hardening-")))
    try:
        worker = state.endpoints[0]
        pid = next(p.pid for p in state.procs if p.name.startswith("worker"))
        corpus_rows(rep, {"gateway": state.gateway_url, "worker": f"http://{worker}"})
        limit_rows(rep, f"http://{worker}", pid, args.pairs)
    finally:
        stop_stack(state)
    if args.soak_seconds > 0:
        soak_rows(rep, args.soak_seconds, args.soak_max_memory)
    rep.emit(args.json)
    return 0
