"""`python -m kvyard.stack.autoscale`: the local stack's KEDA, for `kvyard up --scale-to-zero`.

A real client of the EPP's `externalscaler.ExternalScaler` (protocols.md §6) that
scales the way KEDA scales an `external-push` ScaledObject:

* `StreamIsActive` is held open; every `true` on it scales a pool at zero to
  max(min, 1) at once (KEDA's push path). `false` is ignored. A broken stream is
  reopened after 2 s, doubling to 60 s (KEDA's backoff), reset once one stays up.
* Every `polling_s`, `IsActive` then `GetMetricSpec` + `GetMetrics` (KEDA's loop and
  its HPA): active or not, replicas between 1 and the max follow
  ceil(metric / target), a scale-down only once that holds for `window_s` (the
  HPA's stabilization); not active for `cooldown_s` since the last active answer
  (`cooldownPeriod`): to the minimum, zero with scale-to-zero.
* `--metadata KEY=VALUE` adds scalerMetadata (`targetValue`, `ttftMs`, `signal`,
  `leadMs`, ...: epp/scaler/meta.py). With the EPP's predictive signal the poll also asks
  the same metric with `signal: backlog`, which KEDA would not: `autoscale.json` then says
  whether the forecast or the backlog asked for each scale-up (`events`).

The decision (`Scaler`) is pure; this process writes it to `autoscale.json` in
the run dir, the desired replicas and what it saw, and wakes the supervisor
(SIGUSR1), which starts and stops the workers (`kvyard.stack.supervise`), as a
Deployment controller acts on the replicas KEDA writes. The supervisor restarts
this process if it dies, like every other.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

log = logging.getLogger("kvyard.autoscale")
FILE = "autoscale.json"
NAMESPACE = "local"          # the ScaledObjectRef's namespace, as KEDA would send one
BACKOFF_S, BACKOFF_MAX_S = 2.0, 60.0
EVENTS = 64  # replica changes kept in autoscale.json


@dataclass(slots=True)
class Target:
    """One ScaledObject's worth of settings."""

    pool: str                 # scalerMetadata.pool: the EPP's --pool-name
    role: str = "both"        # scalerMetadata.role
    min_replicas: int = 0
    max_replicas: int = 1
    cooldown_s: float = 300.0  # cooldownPeriod: idle time before the step to the minimum
    polling_s: float = 30.0   # pollingInterval
    window_s: float = 30.0    # scale-down stabilization between 1 and N
    extra: dict[str, str] = field(default_factory=dict)  # more scalerMetadata (meta.py)

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.role}"

    def metadata(self) -> dict[str, str]:
        return {**self.extra, "pool": self.pool, "role": self.role}

    @property
    def explains(self) -> bool:
        """The metric may hold the EPP's forecast: ask the backlog alone beside it."""
        return self.extra.get("signal", "predictive") != "backlog"


@dataclass(slots=True)
class Scaler:
    """KEDA's decisions for one ScaledObject; `replicas` is what it would write."""

    target: Target
    replicas: int
    last_active: float = 0.0
    active: bool = False
    metric: float | None = None
    metric_target: float | None = None
    reason: str = "start"
    backlog: float | None = None  # the same metric with signal=backlog (`Target.explains`)
    events: deque = field(default_factory=lambda: deque(maxlen=EVENTS))  # replica changes
    _recs: deque = field(default_factory=deque)  # (time, HPA recommendation)

    def hold(self, now: float) -> None:
        """The replicas now count as a recommendation: a pool that starts (or resumes) at N
        is not taken below N before the stabilization window has passed (the HPA starts
        from the Deployment's replicas)."""
        self._recs.append((now, self.replicas))

    def push(self, result: bool, now: float) -> bool:
        """A StreamIsActive answer; True when the replicas changed."""
        if not result:
            return False  # external-push: false is ignored
        self.last_active, self.active = now, True
        if self.replicas == 0:
            return self._set(max(self.target.min_replicas, 1), now, "woken by StreamIsActive")
        return False

    def poll(self, active: bool, metric: float | None, target: float | None,
             now: float, backlog: float | None = None) -> bool:
        """One polling round (IsActive, then the metric if there is one; `backlog`: the
        metric without the forecast, recorded with each change)."""
        t = self.target
        self.active, self.metric, self.metric_target = active, metric, target
        self.backlog = backlog
        if active:
            self.last_active = now
            if self.replicas == 0:
                return self._set(max(t.min_replicas, 1), now, "active (IsActive)")
        elif self.replicas > t.min_replicas and now - self.last_active >= t.cooldown_s:
            self._recs.clear()
            return self._set(t.min_replicas, now, f"idle {t.cooldown_s:g}s (cooldown)")
        if self.replicas == 0 or metric is None or not target:
            return False
        rec = min(t.max_replicas, max(t.min_replicas, 1, math.ceil(metric / target - 1e-9)))
        self._recs.append((now, rec))
        while self._recs and now - self._recs[0][0] > t.window_s:
            self._recs.popleft()
        want = rec if rec > self.replicas else max(r for _, r in self._recs)
        return self._set(want, now, f"metric {metric:g} / target {target:g}")

    def _set(self, n: int, now: float, why: str) -> bool:
        if n == self.replicas:
            return False
        log.info("%s: %d -> %d replicas (%s)", self.target.name, self.replicas, n, why)
        self.events.append({"t": round(now, 3), "from": self.replicas, "to": n,
                            "metric": self.metric, "backlog": self.backlog,
                            "target": self.metric_target, "reason": why})
        self.replicas, self.reason = n, why
        return True

    def snapshot(self, now: float) -> dict:
        t = self.target
        return {"pool": t.pool, "role": t.role, "replicas": self.replicas,
                "min": t.min_replicas, "max": t.max_replicas, "active": self.active,
                "metric": self.metric, "backlog": self.backlog, "target": self.metric_target,
                "reason": self.reason, "events": list(self.events),
                "idle_s": round(now - self.last_active, 1) if self.last_active else None,
                "cooldown_s": t.cooldown_s, "polling_s": t.polling_s}


@dataclass(slots=True)
class Autoscaler:
    """The client: a push stream and a polling loop per target, one gRPC channel."""

    address: str
    scalers: list[Scaler]
    on_change: Callable[["Autoscaler"], None] = lambda _a: None
    stream_state: dict[str, str] = field(default_factory=dict)
    pushes: int = 0
    errors: int = 0
    last_error: str = ""

    async def run(self, stop: asyncio.Event) -> None:
        from kvyard.common import keda

        async with grpc.aio.insecure_channel(self.address) as ch:
            stub = keda.pb2_grpc.ExternalScalerStub(ch)
            tasks = [asyncio.create_task(f(stub, s, keda.pb2))
                     for s in self.scalers for f in (self._stream, self._poll)]
            try:
                await stop.wait()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _ref(self, s: Scaler, pb2, **override: str):
        return pb2.ScaledObjectRef(name=s.target.name, namespace=NAMESPACE,
                                   scalerMetadata={**s.target.metadata(), **override})

    def _failed(self, what: str, e: grpc.aio.AioRpcError) -> None:
        self.errors += 1
        self.last_error = f"{what}: {e.code().name} {e.details()}"

    async def _stream(self, stub, s: Scaler, pb2) -> None:
        delay = BACKOFF_S
        while True:
            opened = time.monotonic()
            self.stream_state[s.target.name] = "connecting"
            try:
                async for msg in stub.StreamIsActive(self._ref(s, pb2)):
                    self.stream_state[s.target.name] = "open"
                    if msg.result:
                        self.pushes += 1
                    if s.push(msg.result, time.monotonic()):
                        self.on_change(self)
                why = "the stream ended"
            except grpc.aio.AioRpcError as e:
                self._failed("StreamIsActive", e)
                why = e.code().name
            if time.monotonic() - opened > BACKOFF_MAX_S:
                delay = BACKOFF_S  # it stayed up: start the backoff over
            self.stream_state[s.target.name] = f"retry in {delay:g}s"
            log.info("%s: StreamIsActive: %s; again in %gs", s.target.name, why, delay)
            await asyncio.sleep(delay)  # the backoff, not a synchronisation
            delay = min(BACKOFF_MAX_S, delay * 2)

    async def _poll(self, stub, s: Scaler, pb2) -> None:
        while True:
            ref = self._ref(s, pb2)
            try:
                active = (await stub.IsActive(ref, timeout=5)).result
                metric = target = backlog = None
                spec = (await stub.GetMetricSpec(ref, timeout=5)).metricSpecs
                if spec:
                    m = spec[0]
                    target = m.targetSizeFloat or float(m.targetSize)
                    metric = await _metric(stub, pb2, ref, m.metricName)
                    if s.target.explains:
                        backlog = await _metric(stub, pb2, self._ref(s, pb2, signal="backlog"),
                                                m.metricName)
            except grpc.aio.AioRpcError as e:
                self._failed("poll", e)  # KEDA keeps the replicas when its scaler errs
            else:
                s.poll(active, metric, target, time.monotonic(), backlog)
            self.on_change(self)  # published every round: status shows what was seen
            await asyncio.sleep(s.target.polling_s)  # the polling interval

    def snapshot(self) -> dict:
        now = time.monotonic()
        return {"address": self.address, "pid": os.getpid(), "updated": time.time(),
                "pushes": self.pushes, "errors": self.errors, "last_error": self.last_error,
                "streams": dict(self.stream_state),
                "pools": [s.snapshot(now) for s in self.scalers]}


async def _metric(stub, pb2, ref, name: str) -> float | None:
    vals = (await stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=ref, metricName=name),
                                  timeout=5)).metricValues
    return (vals[0].metricValueFloat or float(vals[0].metricValue)) if vals else None


def write_file(run_dir: Path, doc: dict) -> None:
    path = run_dir / FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)  # atomic: the supervisor never reads half a file


def read_file(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / FILE).read_text())
    except (OSError, ValueError):
        return None


def desired(run_dir: Path) -> dict[str, int]:
    """role -> replicas, as the autoscaler last wrote them ({} before it has)."""
    doc = read_file(run_dir) or {}
    return {p["role"]: int(p["replicas"]) for p in doc.get("pools", [])
            if isinstance(p, dict) and "role" in p and "replicas" in p}


def _wake_supervisor(run_dir: Path) -> None:
    """SIGUSR1 to the supervisor named in the state file: it acts at once, not at its
    next poll."""
    try:
        sup = (json.loads((run_dir / "state.json").read_text()).get("supervisor") or {})
        if sup.get("pid"):
            os.kill(int(sup["pid"]), signal.SIGUSR1)
    except (OSError, ValueError):
        pass


def command(run_dir: Path, address: str, t: Target, replicas: int) -> list[str]:
    return [sys.executable, "-m", "kvyard.stack.autoscale", "--run-dir", str(run_dir),
            "--scaler-address", address, "--pool", t.pool, "--role", t.role,
            "--min", str(t.min_replicas), "--max", str(t.max_replicas),
            "--idle-seconds", f"{t.cooldown_s:g}", "--polling-seconds", f"{t.polling_s:g}",
            "--window-seconds", f"{t.window_s:g}", "--replicas", str(replicas),
            *[f"--metadata={k}={v}" for k, v in t.extra.items()]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--scaler-address", required=True, help="the EPP's scaler, host:port")
    p.add_argument("--pool", required=True, help="scalerMetadata.pool (the EPP's --pool-name)")
    p.add_argument("--role", default="both", choices=("both", "decode", "prefill"))
    p.add_argument("--min", type=int, default=0)
    p.add_argument("--max", type=int, default=1)
    p.add_argument("--idle-seconds", type=float, default=300.0, help="cooldownPeriod")
    p.add_argument("--polling-seconds", type=float, default=30.0, help="pollingInterval")
    p.add_argument("--window-seconds", type=float, default=30.0,
                   help="scale-down stabilization between 1 and max")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="more scalerMetadata, e.g. targetValue=0.8, signal=backlog, "
                        "leadMs=90000 (epp/scaler/meta.py)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas now (default: the last autoscale.json's, else --max)")
    a = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= a.min <= a.max or a.max < 1:
        p.error("want 0 <= --min <= --max and --max >= 1")
    extra = dict(kv.partition("=")[::2] for kv in a.metadata)
    if any(not k or k in ("pool", "role") for k in extra):
        p.error("--metadata KEY=VALUE, a key other than pool and role (--pool, --role)")
    run = Path(a.run_dir).resolve()
    t = Target(a.pool, a.role, a.min, a.max, a.idle_seconds, a.polling_seconds,
               a.window_seconds, extra)
    # A restart resumes from the replicas it last wrote (the workers that run now).
    now = desired(run).get(a.role, a.replicas if a.replicas is not None else a.max)
    scaler = Scaler(t, now, last_active=time.monotonic())
    scaler.hold(time.monotonic())

    def publish(auto: Autoscaler) -> None:
        before = desired(run).get(t.role, now)
        write_file(run, auto.snapshot())
        if before != scaler.replicas:
            _wake_supervisor(run)

    auto = Autoscaler(a.scaler_address, [scaler], on_change=publish)
    publish(auto)

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await auto.run(stop)

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
