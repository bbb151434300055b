"""`kvyard bench coldstart`: a request at a pool scaled to zero, to its first token.

Two parts, both on the demo model (or `--model`), real processes:

1. Worker start to ready, `--phase-reps` times: `coldstart_phases` (a fresh process
   running what `kvyard worker` runs before it listens: interpreter, torch, kvyard's
   imports, the CPU kernels (cached), the kvstore connector, the weights, the
   tokenizer, the rest of the engine (KV cache), then a first and a second step of
   one prompt: the warm-up) and a real `kvyard worker` from spawn to `/health` 200.
2. `kvyard up --workers 1 --scale-to-zero` (autoscaler, supervisor, EPP, Envoy): `--reps`
   times, wait for the pool at zero, send a streamed chat request through the
   gateway and split its time to the first token into the wake-up signal (request
   sent -> the autoscaler's push-driven scale-up, from its log), the supervisor's
   spawn (-> its "started worker" line), the worker's start (-> its "serving" log
   line) and the rest (EPP scrape + dispatch + first token); once with the spare
   interpreter `kvyard up` keeps (kvyard.stack.prestart) and once with a plain process
   start (`--no-prestart`). Baselines from the same run: the same request at the warm pool right after (its first token), and
   KEDA-style polling at `--keda-polling` seconds (30, KEDA's default), simulated: the
   measured arrival-to-first-token with the push signal replaced by a wait uniform
   over one polling interval (a request arrives at a random point of the period).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvyard.bench import servers
from kvyard.bench.client import chat_body, stream_once
from kvyard.bench.report import Report, percentile

PROMPT = "Name one colour of the sky."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=20, help="wake-ups from zero")
    p.add_argument("--phase-reps", type=int, default=3, help="worker start breakdowns")
    p.add_argument("--model", default="demo")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--idle-seconds", type=float, default=1.0,
                   help="the bench's scale-to-zero idle time (short, to cycle quickly)")
    p.add_argument("--keda-polling", type=float, default=30.0,
                   help="the simulated polling baseline's interval (KEDA's default 30 s)")
    p.add_argument("--seed", type=int, default=0, help="the simulated baseline's arrivals")
    p.add_argument("--modes", default="spare,plain",
                   help="wake-ups with the spare interpreter (kvyard up's default) and/or "
                        "with a plain process start (--no-prestart), in one run")
    p.add_argument("--json", action="store_true")


def _kvyard(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _log_time(line: str) -> float | None:
    """The epoch time of a `%(asctime)s` log line (local time, millisecond precision)."""
    try:
        stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return None
    return stamp.timestamp()


def _last(path: Path, needle: str, after: float) -> float | None:
    """The time of the first line containing `needle` logged at or after `after`."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        t = _log_time(line)
        if t is not None and t >= after - 0.002 and needle in line:
            return t
    return None


def worker_phases(model: str, flags: list[str]) -> dict:
    t_spawn = time.time()
    out = subprocess.run([sys.executable, "-m", "kvyard.bench.coldstart_phases", "--model",
                          model, *flags], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"coldstart_phases failed: {out.stderr[-2000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    t, s = d["t"], d["spans"]
    engine = t["engine"] - t["connector"]
    return {"interpreter": t["start"] - t_spawn, "torch": t["torch"] - t["start"],
            "kvyard imports": t["imports"] - t["torch"], "kernels": t["kernels"] - t["imports"],
            "connector": t["connector"] - t["kernels"], "weights": s.get("weights", 0.0),
            "tokenizer": s.get("tokenizer", 0.0),
            "engine rest (KV cache)": engine - s.get("weights", 0.0) - s.get("tokenizer", 0.0),
            "first step": d["steps"][0], "second step": d["steps"][1],
            "total": t["engine"] - t_spawn}


def worker_ready(cmd: list[str], port: int, log: Path, timeout_s: float = 600) -> float:
    """Spawn -> /health 200 of a real `kvyard worker`, stopped afterwards."""
    with servers.Server("bench-worker", cmd, port, startup_timeout_s=timeout_s, log_path=log,
                        poll_s=0.01) as w:
        return w.startup_s


def first_token(url: str, max_tokens: int, timeout: float = 600) -> tuple[float, str]:
    """Seconds from sending a streamed chat request to its first token (`bench.client`'s
    TTFT), and the whole answer."""
    body = chat_body("SmolLM2-135M-Instruct", PROMPT, max_tokens, ignore_eos=False)
    r = asyncio.run(stream_once(url, body, timeout))
    if r.error is not None:
        raise RuntimeError(r.error)
    return r.ttft_s, r.text


def wake_cycles(a: argparse.Namespace, rd: Path, port: int) -> list[dict]:
    from kvyard.stack import autoscale, procs
    from kvyard.stack.state import StackState

    def at_zero() -> bool:
        """No worker, and the spare (if the stack keeps one) done with its imports, as it
        is after any idle time longer than those imports."""
        from kvyard.stack import prestart

        s = StackState.load(rd)
        doc = autoscale.read_file(rd) or {}
        if s is None or [p for p in s.procs if p.name.startswith("worker-")] \
                or not doc.get("pools") or doc["pools"][0]["replicas"] != 0:
            return False
        spares = [p for p in s.procs if p.name == "spare"]
        return not s.scaling.get("warm") or bool(spares) and all(
            prestart.ready_file(rd, p.pid).exists() for p in spares)

    url = f"http://127.0.0.1:{port}"
    out, old = [], []
    for _ in range(a.reps):
        deadline = time.monotonic() + 120
        # At zero with the last worker gone: its drain does not share the CPU with the wake.
        while not at_zero() or any(procs.alive(pid) for pid in old):
            if time.monotonic() > deadline:
                raise RuntimeError("the pool did not scale to zero")
            time.sleep(0.05)
        sent = time.time()
        ttft, text = first_token(url, a.max_tokens)
        warm, warm_text = first_token(url, a.max_tokens)
        s = StackState.load(rd)
        [w] = [p for p in s.procs if p.name.startswith("worker-")]
        old = [w.pid]
        woke = _last(rd / "logs" / "autoscaler.log", "woken by StreamIsActive", sent)
        started = _last(rd / "logs" / "supervisor.log", f" {w.name} (pid", sent)
        ready = _last(Path(w.log), "kvyard.server: serving", sent)
        if None in (woke, started, ready):
            raise RuntimeError(f"missing timestamps: woke {woke}, started {started}, "
                               f"ready {ready}")
        out.append({"ttft": ttft, "warm": warm, "same": text == warm_text,
                    "signal": woke - sent, "spawn": started - woke,
                    "worker start": ready - started, "rest": sent + ttft - ready})
    return out


def stack_cycles(args: argparse.Namespace, tmp: Path, prestart: bool
                 ) -> tuple[list[dict], list[str]]:
    """`kvyard up --scale-to-zero` (with or without the spare), its wake-ups, and the
    worker flags it runs."""
    from kvyard.stack import procs
    from kvyard.stack.state import StackState

    rd, port = tmp / f"run-{'spare' if prestart else 'plain'}", procs.free_port()
    up = _kvyard("up", "--workers", "1", "--scale-to-zero", "--idle-seconds",
                 f"{args.idle_seconds:g}", "--polling-seconds", "0.5", "--model", args.model,
                 "--port", str(port), "--run-dir", str(rd),
                 "--prestart" if prestart else "--no-prestart")
    if up.returncode != 0:
        raise RuntimeError(up.stdout + up.stderr)
    try:
        flags = list(StackState.load(rd).scaling["template"])
        return wake_cycles(args, rd, port), flags[flags.index("--model") + 2:]
    finally:
        _kvyard("down", "--run-dir", str(rd))


def _rows(rep: Report, part: str, cycles: list[dict]) -> None:
    names = {"signal": "wake-up signal (StreamIsActive push)",
             "spawn": "supervisor: worker process started (or spare woken)",
             "worker start": "worker process -> serving",
             "rest": "ready -> first token (EPP scrape, dispatch, prefill)",
             "ttft": "arrival at zero -> first token",
             "warm": "baseline: warm pool's first token"}
    for step, name in names.items():
        v = [c[step] for c in cycles]
        rep.add(part=part, step=name, p50_s=percentile(v, 50), p90_s=percentile(v, 90),
                n=len(v))


def run(args: argparse.Namespace) -> int:
    from kvyard.stack import procs

    rep = Report("kvyard bench coldstart: a request at zero workers to its first token",
                 ["part", "step", "p50_s", "p90_s", "n"])
    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="kvyard-coldstart-") as tmp:
        runs = {m: stack_cycles(args, Path(tmp), m == "spare") for m in modes}
        flags = next(iter(runs.values()))[1]
        wport = procs.free_port()
        flags = [x.replace("{port}", str(wport)) for x in flags]
        phases = [worker_phases(args.model, flags) for _ in range(args.phase_reps)]
        cmd = [sys.executable, "-m", "kvyard.cli", "worker", "--model", args.model, *flags]
        ready = [worker_ready(cmd, wport, Path(tmp) / f"w{i}.log")
                 for i in range(args.phase_reps)]
    for step in phases[0]:
        v = [p[step] for p in phases]
        rep.add(part="worker start (in-process phases)", step=step, p50_s=percentile(v, 50),
                p90_s=percentile(v, 90), n=len(v))
    rep.add(part="worker start", step="spawn -> /health 200 (kvyard worker)",
            p50_s=percentile(ready, 50), p90_s=percentile(ready, 90), n=len(ready))
    rng = random.Random(args.seed)
    for mode, (cycles, _) in runs.items():
        part = "gateway, " + ("spare interpreter" if mode == "spare" else "plain spawn")
        _rows(rep, part, cycles)
        polled = [c["ttft"] - c["signal"] + rng.uniform(0, args.keda_polling) for c in cycles]
        rep.add(part=part, step=f"baseline: KEDA polling {args.keda_polling:g}s (simulated)",
                p50_s=percentile(polled, 50), p90_s=percentile(polled, 90), n=len(polled))
        rep.notes.append(f"{part}: greedy answers after a wake-up equal the warm pool's: "
                         f"{sum(c['same'] for c in cycles)}/{len(cycles)}")
    rep.notes.append("target: arrival -> first token p90 <= 3 s, of which the signal <= 0.1 s")
    rep.meta.update(model=args.model, reps=args.reps, phase_reps=args.phase_reps,
                    cycles={m: c for m, (c, _) in runs.items()}, phases=phases, ready_s=ready)
    rep.emit(args.json)
    return 0
