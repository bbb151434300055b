"""`kvyard sim serve`'s flags. Where llm-d-inference-sim has the knob, its name is used
(docs/configuration.md there): --max-num-seqs, --max-model-len, --kv-cache-size,
--block-size, --enable-kvcache, --zmq-endpoint, --event-batch-size,
--kv-events-replay-endpoint, --prefill-overhead, --prefill-time-per-token,
--prefill-time-std-dev, --inter-token-latency, --inter-token-latency-std-dev,
--kv-cache-transfer-latency, --kv-cache-transfer-time-per-token,
--kv-cache-transfer-time-std-dev, --seed. Durations are llm-d's: "100ms", "250us", "1.5s"
(a bare number is milliseconds, as llm-d's deprecated integer form).
vLLM's --max-num-batched-tokens and LoRA flags (--enable-lora, --lora-modules, --max-loras;
lora.py, with kvyard's --lora-load-time); kvyard's own: --profile, --itl-per-running-seq (ITL growth per extra running sequence),
--time-scale, --start-delay, --min-step, --pods/--ports/--roles/--first-pod (many pods in one
process) and vLLM's --kv-events-config (the worker's flag). A bound KV-event endpoint (a
wildcard, as the worker's) and the replay endpoint get port + the pod's index in the pool; a
connected one (llm-d's central listener) is shared by every pod.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace

from kvyard.common.kv_events import KVEventsConfig
from kvyard.common.wire import ROLES
from kvyard.sim.profiles import LatencyProfile, load_profile

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|µs|ms|s|m)?\s*$")
_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, None: 1e-3}
# flag -> LatencyProfile field
LATENCY_FLAGS = {
    "prefill_overhead": "prefill_overhead",
    "prefill_time_per_token": "prefill_time_per_token",
    "prefill_time_std_dev": "prefill_time_std_dev",
    "inter_token_latency": "inter_token_latency",
    "inter_token_latency_std_dev": "inter_token_latency_std_dev",
    "itl_per_running_seq": "itl_per_running_seq",
    "kv_cache_transfer_latency": "kv_transfer_latency",
    "kv_cache_transfer_time_per_token": "kv_transfer_time_per_token",
    "kv_cache_transfer_time_std_dev": "kv_transfer_std_dev",
}


def duration(text: str) -> float:
    """Seconds from llm-d's duration form."""
    m = _DURATION.match(str(text))
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 100ms, 250us, 1.5s)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pods")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="the first pod's port")
    g.add_argument("--pods", type=int, default=1, help="pods in this process (ports from --port)")
    g.add_argument("--ports", default=None, help="comma-separated ports, one pod each "
                                                   "(instead of --port/--pods)")
    g.add_argument("--roles", default=None,
                   help="comma-separated roles, one per pod (both|prefill|decode)")
    g.add_argument("--role", choices=ROLES, default="both", help="every pod's role")
    g.add_argument("--first-pod", type=int, default=0, metavar="I",
                   help="the first pod's index in the whole pool (KV-event ports and seeds are "
                        "offset by the index, so several processes share one flag set)")
    g.add_argument("--advertise-address", default=None,
                   help="one pod: the address it names itself by (x-kvyard-endpoint)")
    g.add_argument("--pd-key-file", default=None,
                   help="P/D: the key that signs prefill targets (kvyard.common.pd_auth)")
    g.add_argument("--model", default="demo", help="whose tokenizer and chat template to use")
    g.add_argument("--served-model-name", action="append", default=[])
    g.add_argument("--max-model-len", type=int, default=8192)
    g = p.add_argument_group("LoRA (vLLM's flags; lora.py)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (implied by --lora-modules)")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="adapters a request may name as its model")
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters active at once (an LRU; vLLM's default 1)")
    g.add_argument("--lora-load-time", type=duration, default=None, metavar="DUR",
                   help="simulated cost of activating an adapter (default 500ms, lora.py's source)")
    g = p.add_argument_group("engine")
    g.add_argument("--profile", default="cpu-demo",
                   help="latency profile: cpu-demo, h100, h200, or a JSON file "
                        "(`kvyard sim calibrate` writes one)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="running sequences per step at most (default: the profile's)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step at most, prefill chunks included (default: the "
                        "profile's)")
    g.add_argument("--kv-cache-size", type=int, default=4096, help="KV blocks per pod")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the engine's 16)")
    g.add_argument("--enable-kvcache", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix caching (and its KV events); off: every prompt is computed")
    g = p.add_argument_group("latency (override the profile)")
    for flag in LATENCY_FLAGS:
        g.add_argument("--" + flag.replace("_", "-"), type=duration, default=None, metavar="DUR")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated seconds per wall second (latency.py says what it distorts)")
    g.add_argument("--start-delay", type=duration, default=0.0, metavar="DUR",
                   help="simulated start time: /health is 503 (starting) and nothing is "
                        "served until this long after the process serves (e.g. 90s: a GPU "
                        "pod's image and weights; startup.py)")
    g.add_argument("--min-step", type=duration, default=duration("2ms"), metavar="DUR",
                   help="shortest wall-clock wait per step; shorter decode steps are merged")
    g.add_argument("--seed", type=int, default=None, help="jitter RNG seed (per pod: seed + i)")
    g = p.add_argument_group("KV events")
    g.add_argument("--kv-events-config", default=None,
                   help="vLLM's JSON (as `kvyard worker`); topic may use {address} and {model}")
    g.add_argument("--zmq-endpoint", default=None,
                   help="llm-d-inference-sim's: publish here (a wildcard binds, else connect)")
    g.add_argument("--kv-events-replay-endpoint", default=None, help="ROUTER for replays")
    g.add_argument("--event-batch-size", type=int, default=0,
                   help="events per published batch at most (0: a step's events together)")
    g.add_argument("--kv-events-form", choices=("array", "map"), default="array",
                   help="each event positional (vLLM's array_like structs) or a map tagged "
                        "\"type\" (newer vLLM; what vllm-router's kv_aware reads); the batch "
                        "is positional either way")
    p.add_argument("--log-level", default="warning")


@dataclass(slots=True)
class PodPlan:
    port: int
    role: str
    address: str
    kv_events: KVEventsConfig | None


def profile_of(a: argparse.Namespace) -> LatencyProfile:
    prof = load_profile(a.profile)
    for flag, attr in LATENCY_FLAGS.items():
        v = getattr(a, flag)
        if v is not None:
            setattr(prof, attr, v)
    if a.max_num_seqs is not None:
        prof.max_num_seqs = a.max_num_seqs
    if a.max_num_batched_tokens is not None:
        prof.max_num_batched_tokens = a.max_num_batched_tokens
    return prof


def kv_events_of(a: argparse.Namespace) -> KVEventsConfig | None:
    if a.kv_events_config:
        cfg = KVEventsConfig.parse(a.kv_events_config)
        return cfg if cfg.active else None
    if a.zmq_endpoint:
        # llm-d's topic: the subscriber reads the pod and the model from it
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=a.zmq_endpoint, replay_endpoint=a.kv_events_replay_endpoint,
                              topic="kv@{address}@{model}")
    return None


def plan_pods(a: argparse.Namespace) -> list[PodPlan]:
    """Each pod's port, role, address and KV-event endpoints (offset by the pod's index)."""
    from kvyard.sim.events import binds, offset_endpoint

    ports = [int(x) for x in a.ports.split(",")] if a.ports else \
        [a.port + i for i in range(a.pods)]
    if not ports:
        raise ValueError("no pods: give --pods N or --ports")
    roles = a.roles.split(",") if a.roles else [a.role] * len(ports)
    if len(roles) != len(ports) or any(r not in ROLES for r in roles):
        raise ValueError(f"--roles: one of {ROLES} per pod ({len(ports)} pods)")
    if a.advertise_address and len(ports) > 1:
        raise ValueError("--advertise-address names one pod")
    base = kv_events_of(a)
    out = []
    for i, (port, role) in enumerate(zip(ports, roles), start=a.first_pod):
        addr = a.advertise_address or f"{a.host}:{port}"
        ev = None
        if base is not None and a.enable_kvcache:
            # a bound endpoint is each pod's own (port + index); a connected one is a
            # central subscriber that every pod publishes to (llm-d's --zmq-endpoint)
            ev = replace(base, endpoint=offset_endpoint(base.endpoint, i)
                         if binds(base.endpoint) else base.endpoint,
                         replay_endpoint=base.replay_endpoint and
                         offset_endpoint(base.replay_endpoint, i))
        out.append(PodPlan(port, role, addr, ev))
    return out
