"""`kvyard bench slo`'s autoscaling comparison on a real stack: simulated pods started and
stopped by the local autoscaler, which the EPP's KEDA scaler drives.

Per mode a fresh `kvyard up --sim N --scale-to-zero` stack (`start_supervised`, the code
`kvyard up` runs): `kvyard sim serve` pods (one process each, the h100 profile), the EPP
(load scorers and the latency scorer, whose predictor counts the arrivals the forecast
reads), Envoy, the supervisor that starts and stops pods to `autoscale.json`, and the
autoscaler (`kvyard.stack.autoscale`, a gRPC client of the EPP's scaler that polls as KEDA
does). The pool starts at `start_pods`, scales between 1 and `max_pods`; a pod the
autoscaler adds is ready `pod_start_s` after it starts (`kvyard sim serve --start-delay`).
The two modes differ in one scalerMetadata key only: `signal: backlog` (reactive) or
`signal: predictive` (the larger of the backlog and the forecast, `leadMs` = the pod start).
Traffic (`slo_autoscale_traffic.Ramp`): open-loop Poisson arrivals of unique prompts
through Envoy, the same arrivals and prompts for both modes. The requests are
prefill-bound (2,000-token prompts, one-token answers: scoring, classification, RAG
reranking), so TTFT is the objective that binds and the scaler sizes the pool by its
measured prefill rate; with longer answers its decode term would bind instead, and on
colocated pods its TPOT fit counts the steps' prefill time as decode time.

Every time here is simulated seconds: the pods run `--time-scale S` (S simulated seconds
per wall second), and what the EPP and the autoscaler take in wall time (the TTFT/TPOT
objectives, the polling interval, the stabilization window, the forecast's horizon) is the
simulated value / S. Reported per mode: TTFT attainment, goodput (requests/s meeting the
TTFT objective), pod-seconds (pods started and not yet stopped, integrated over the
traffic), peak pods, the scale events with the metric and the backlog-only metric that the
autoscaler saw, and the measured start (pod started -> the EPP's first good scrape).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvyard.bench.slo_autoscale_traffic import Ramp, Sample, summarize

MODES = {"reactive": "backlog", "predictive": "predictive"}
POD_START_S = 60.0  # a GPU pod: image pulled, weights loaded


@dataclass(slots=True)
class Settings:
    ramp: Ramp = field(default_factory=Ramp)
    max_pods: int = 8
    start_pods: int = 2
    pod_start_s: float = POD_START_S
    time_scale: float = 2.0
    profile: str = "h100"
    prompt_tokens: int = 2000
    output_tokens: int = 1        # prefill-bound (RAG, classification): see the docstring
    ttft_s: float = 1.5           # the TTFT objective
    tpot_s: float = 0.2           # the TPOT objective the scaler sizes decode by
    polling_s: float = 10.0       # KEDA's pollingInterval
    window_s: float = 30.0        # the HPA's scale-down stabilization
    target: float = 0.6           # KEDA's targetValue (replicas = ceil(metric / target))
    lead_s: float | None = None   # the forecast's horizon; None: pod_start_s
    seed: int = 0

    def wall(self, sim_s: float) -> float:
        return sim_s / self.time_scale

    def metadata(self, mode: str) -> dict[str, str]:
        lead = self.pod_start_s if self.lead_s is None else self.lead_s
        return {"targetValue": f"{self.target:g}", "signal": MODES[mode],
                "ttftMs": f"{self.wall(self.ttft_s) * 1000:g}",
                "tpotMs": f"{self.wall(self.tpot_s) * 1000:g}",
                "leadMs": f"{max(1.0, self.wall(lead) * 1000):g}"}


def _spec(st: Settings, mode: str, run: Path, epp_config: Path):
    from kvyard.stack.sim_pool import epp_args
    from kvyard.stack.spec import StackSpec

    spec = StackSpec(run_dir=run, workers=st.start_pods, gateway_port=None, kv_tiers=False,
                     kv_events=False, scale_to_zero=True, idle_seconds=1e6,
                     polling_seconds=st.wall(st.polling_s), scale_window_s=st.wall(st.window_s),
                     scale_min=1, scale_max=st.max_pods, scaler_metadata=st.metadata(mode),
                     scale_up_args=["--start-delay", f"{st.pod_start_s:g}s"],
                     ready_timeout_s=120.0)
    spec.worker_base_port = spec.admin_port = spec.scaler_port = None
    spec.epp_ports = (None, None, None)
    spec.sim, spec.sim_profile = st.start_pods, st.profile
    spec.sim_kv_cache_size = 8192
    spec.sim_args = ["--time-scale", f"{st.time_scale:g}", "--seed", str(st.seed)]
    spec.epp_args = [*epp_args(st.max_pods), "--config", str(epp_config)]
    return spec


def _epp_config(run: Path) -> Path:
    from kvyard.bench.route_policies import LOAD, Policy

    # The latency scorer's predictor counts the arrivals and predicts output lengths: the
    # forecast's inputs. Without SLO headers it does not change the routing.
    return Policy("autoscale", [*LOAD, {"type": "latency", "weight": 1}]).write(run)


async def _watch(run: Path, metrics_url: str, t0: float, stop: asyncio.Event,
                 out: list[Sample], interval: float = 0.2) -> None:
    """What the pool looks like every `interval` wall seconds: pods started (the state's
    workers), pods the EPP scrapes, the autoscaler's replicas and metrics."""
    import aiohttp

    from kvyard.stack import autoscale
    from kvyard.stack.state import StackState

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while not stop.is_set():
            state = StackState.load(run)
            started = list(state.endpoints) if state else []
            ready: list[str] = []
            try:
                async with s.get(metrics_url + "/debug/endpoints") as r:
                    doc = await r.json()
                rows = doc.get("endpoints", []) if isinstance(doc, dict) else doc
                ready = [e["address"] for e in rows
                         if not e.get("down") and e.get("age_s") is not None]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            pool = ((autoscale.read_file(run) or {}).get("pools") or [{}])[0]
            out.append(Sample(time.monotonic() - t0, started, ready, pool.get("replicas"),
                              pool.get("metric"), pool.get("backlog")))
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


async def _drive(url: str, metrics_url: str, run: Path, st: Settings, at: list[float],
                 texts: list[str]):
    import aiohttp

    from kvyard.bench.client import completion_body, stream

    samples: list[Sample] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        loop = asyncio.get_running_loop()
        t0, mono0 = loop.time(), time.monotonic()
        watcher = asyncio.create_task(_watch(run, metrics_url, mono0, stop, samples))

        async def one(at_s: float, text: str):
            delay = t0 + st.wall(at_s) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule
            return await stream(s, url, completion_body(None, text, st.output_tokens))

        res = await asyncio.gather(*(one(a, x) for a, x in zip(at, texts)))
        stop.set()
        await watcher
    return res, samples, mono0


def run_mode(st: Settings, mode: str, root: Path, at: list[float], texts: list[str]) -> dict:
    from kvyard.stack import autoscale
    from kvyard.stack.launch import stop_stack
    from kvyard.stack.state import StackState
    from kvyard.stack.up import start_supervised

    run = root / mode
    run.mkdir(parents=True, exist_ok=True)
    spec = _spec(st, mode, run, _epp_config(run))
    error = start_supervised(spec)
    state = StackState.load(run)
    if error is not None or state is None:
        raise RuntimeError(f"autoscale {mode}: the stack did not start: {error}")
    try:
        res, samples, mono0 = asyncio.run(_drive(state.gateway_url, state.epp_metrics_url, run, st,
                                          at, texts))
        doc = autoscale.read_file(run) or {}
        scaler = _scaler_view(state.epp_metrics_url)
    finally:
        stop_stack(StackState.load(run) or state)
    pool = (doc.get("pools") or [{}])[0]
    out = summarize(st, res, at, samples)
    # the autoscaler's monotonic clock is this process's: its events on the traffic's time
    out["events"] = [{**e, "t": round((e["t"] - mono0) * st.time_scale - st.ramp.warmup_s, 1)}
                     for e in pool.get("events", []) if e.get("t") is not None]
    out["autoscaler_errors"] = doc.get("errors")
    out["epp_capacity_wall"] = scaler.get("capacity", {}).get("both")
    return out


def _scaler_view(metrics_url: str) -> dict:
    """The EPP's scaler as /debug/endpoints shows it (its measured capacity, wall units)."""
    from kvyard.stack import procs

    try:
        code, body = procs.http_get(metrics_url + "/debug/endpoints", 5.0)
        return (json.loads(body).get("scaler") or {}) if code == 200 else {}
    except (OSError, ValueError, AttributeError):
        return {}


def prompts(n: int, tokens: int, seed: int) -> list[str]:
    """n unique prompts of `tokens` tokens each (route_workload's one-token words: the
    simulator and the EPP count exactly these tokens)."""
    from kvyard.bench.route_workload import Segment, Vocab

    vocab = Vocab.demo()
    return [vocab.text(Segment(seed * 1_000_003 + i, tokens).ids(vocab.ids)) for i in range(n)]


def compare(st: Settings, root: Path) -> dict:
    """Both modes on the same arrivals and prompts, one after the other."""
    at = st.ramp.arrivals(random.Random(st.seed))
    texts = prompts(len(at), st.prompt_tokens, st.seed)
    t0 = time.monotonic()
    out: dict = {m: run_mode(st, m, root, at, texts) for m in MODES}
    conf = asdict(st)
    conf["requests"] = len(at)
    conf["wall_s"] = round(time.monotonic() - t0, 1)
    conf["metadata"] = {m: st.metadata(m) for m in MODES}
    out["model"] = {"kind": "stack", **conf}
    return out
