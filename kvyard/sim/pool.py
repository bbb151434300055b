"""Many simulated pods in one process: one event loop, one tokenizer, one aiohttp runner and
one TCP site per pod, one ZMQ context for every pod's KV-event sockets.

An idle pod costs nothing but its listening socket: its engine task waits on an event,
its replay task in the ZMQ poller, and nothing polls. `serve` runs until SIGTERM/SIGINT.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvyard.common import pd_auth
from kvyard.common.tokenizer import ChatTokenizer, load_tokenizer
from kvyard.sim import startup
from kvyard.sim.cache import BlockPool
from kvyard.sim.config import PodPlan
from kvyard.sim.engine import SimEngine
from kvyard.sim.events import SimPublisher
from kvyard.sim.latency import LatencyModel
from kvyard.sim.lora import DEFAULT_LOAD_S, AdapterSlots, parse_lora_modules
from kvyard.sim.profiles import LatencyProfile
from kvyard.sim.pod import Pod
from kvyard.sim.server import make_app

log = logging.getLogger("kvyard.sim")
FILLER_TEXT = " The quick brown fox jumps over the lazy dog."


def filler_ids(tok: ChatTokenizer) -> tuple[list[int], dict[int, str]]:
    """The fixed token list every pod cycles through, and each id's text."""
    ids = [i for i in tok.encode(FILLER_TEXT) if i not in tok.eos_token_ids] or [0]
    return ids, {i: tok.token_text(i) for i in ids}


@dataclass(slots=True)
class PodSettings:
    profile: LatencyProfile
    kv_cache_size: int = 4096
    block_size: int = 16
    enable_kvcache: bool = True
    max_model_len: int = 8192
    time_scale: float = 1.0
    min_step_s: float = 0.002
    seed: int | None = None
    first_pod: int = 0                   # this process's first pod in the pool (seeds)
    event_batch_size: int = 0
    event_maps: bool = False             # --kv-events-form map
    served: list[str] = field(default_factory=list)
    pd_key: bytes | None = None
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> path
    max_loras: int = 1
    lora_load_s: float = DEFAULT_LOAD_S
    start_delay_s: float = 0.0           # simulated seconds before the pods are ready
    ready_at: float = 0.0                # monotonic; set by `serve` (startup.py)


def build_pod(plan: PodPlan, i: int, s: PodSettings, tok: ChatTokenizer,
              filler: tuple[list[int], dict[int, str]]) -> Pod:
    ids, texts = filler
    model = LatencyModel(s.profile, s.time_scale,
                         None if s.seed is None else s.seed + s.first_pod + i)
    pool = BlockPool(s.kv_cache_size, s.block_size, s.enable_kvcache)
    pub = None
    if plan.kv_events is not None:
        served = s.served[0] if s.served else tok.name
        topic = plan.kv_events.topic.replace("{address}", plan.address).replace("{model}", served)
        pub = SimPublisher(plan.kv_events, topic.encode(), s.event_batch_size, s.event_maps)
    lora = AdapterSlots(dict(s.lora_modules), max(1, s.max_loras), s.lora_load_s) \
        if s.enable_lora or s.lora_modules else None
    engine = SimEngine(pool, model, s.profile.max_num_seqs, ids, s.min_step_s,
                       publish=pub.publish if pub is not None else None,
                       max_num_batched_tokens=s.profile.max_num_batched_tokens, lora=lora)
    return Pod(address=plan.address, role=plan.role, engine=engine, tokenizer=tok,
               served=s.served or [tok.name], max_model_len=s.max_model_len,
               profile_name=s.profile.name, text_of=lambda t: texts.get(t) or tok.token_text(t),
               publisher=pub, pd_key=s.pd_key, ready_at=s.ready_at)


@dataclass(slots=True)
class PodGroup:
    """The running pods of this process."""

    pods: list[Pod] = field(default_factory=list)
    runners: list[web.AppRunner] = field(default_factory=list)
    zmq_ctx: Any = None

    async def start(self, plans: list[PodPlan], s: PodSettings, tok: ChatTokenizer,
                    host: str = "127.0.0.1") -> "PodGroup":
        filler = filler_ids(tok)
        if any(p.kv_events is not None for p in plans):
            import zmq
            import zmq.asyncio

            self.zmq_ctx = zmq.asyncio.Context()
            self.zmq_ctx.setsockopt(zmq.LINGER, 0)
            self.zmq_ctx.set(zmq.MAX_SOCKETS, max(1024, 4 * len(plans) + 64))
        for i, plan in enumerate(plans):
            pod = build_pod(plan, i, s, tok, filler)
            if pod.publisher is not None:
                pod.publisher.start(self.zmq_ctx)
            pod.engine.start()
            runner = web.AppRunner(make_app(pod), access_log=None, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, host, plan.port, reuse_address=True).start()
            self.pods.append(pod)
            self.runners.append(runner)
        return self

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        for pod in self.pods:
            await pod.engine.stop()
            if pod.publisher is not None:
                await pod.publisher.close()
            if pod.session is not None:
                await pod.session.close()
        if self.zmq_ctx is not None:
            self.zmq_ctx.term()


def settings_of(a: Any, profile: LatencyProfile) -> PodSettings:
    key = pd_auth.load_key(a.pd_key_file) if a.pd_key_file else None
    return PodSettings(profile=profile, kv_cache_size=a.kv_cache_size, block_size=a.block_size,
                       enable_kvcache=a.enable_kvcache, max_model_len=a.max_model_len,
                       time_scale=a.time_scale, min_step_s=a.min_step, seed=a.seed,
                       first_pod=a.first_pod,
                       event_batch_size=a.event_batch_size,
                       event_maps=a.kv_events_form == "map", served=list(a.served_model_name),
                       pd_key=key, enable_lora=a.enable_lora,
                       lora_modules=parse_lora_modules(a.lora_modules), max_loras=a.max_loras,
                       lora_load_s=DEFAULT_LOAD_S if a.lora_load_time is None
                       else a.lora_load_time, start_delay_s=a.start_delay)


async def serve(plans: list[PodPlan], s: PodSettings, model_ref: str | Path,
                host: str = "127.0.0.1") -> None:
    s.ready_at = startup.ready_at(s.start_delay_s, s.time_scale)  # the tokenizer loads meanwhile
    tok = load_tokenizer(model_ref)
    group = await PodGroup().start(plans, s, tok, host)
    log.warning("%d simulated pod(s) on %s:%s (profile %s, time scale %g)", len(plans), host,
                ",".join(str(p.port) for p in plans[:8]) + ("..." if len(plans) > 8 else ""),
                s.profile.name, s.time_scale)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await group.stop()
