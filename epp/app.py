"""Wires the EPP together and owns its lifecycle (ports, tasks, threads).

Start order is chosen for a fast, honest start: servers bind first (so
Envoy can connect and get 503s rather than connection errors), discovery and
scraping follow, and the tokenizer loads in a worker thread — until it is
there prompts are hashed as bytes and readiness stays false.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvyard.common import pd_auth, wire

from .admission import Admission, SheddingAdmission
from .director import Director
from .finisher import Finisher
from .flow.config import FlowConfig, duration_s, parse_flow_config
from .flow.controller import FlowController
from .flow.demand import Demand
from .flow.metrics import FlowMetrics
from .health import SERVER_OPTIONS, HealthServer, bind
from .kvevents.sources import KVEventSources
from .models import ModelRoutes
from .observability import EppMetrics, debug_app
from .pool.discovery_file import FileDiscovery
from .pool.discovery_k8s import K8sDiscovery
from .pool.endpoints import EndpointPool, EndpointSpec
from .pool.scraper import Scraper
from .pool.staleness import TimeoutGrace
from .prompt import PromptHasher
from .replicas.apply import PickApplier
from .replicas.bus import PickBus
from .replicas.peers import DnsPeers
from .replicas.wire import REPLICA_PORT
from .scaler.server import ScalerServer
from .scheduling.config import build_scheduler, load_config, with_fallbacks
from .scheduling.scheduler import Scheduler
from .scheduling.scorers.precise_prefix import PrecisePrefixScorer
from .server import ExtProcServicer
from .slo.admission import SloAdmission
from .slo.metrics import SloCollector
from .slo.observe import Observer
from .slo.predictor import LatencyPredictor
from .slo.wiring import annotator, forecaster, latency_scorers
from .tls import tls_files
from .xds import EdsServicer

log = logging.getLogger("kvyard.epp")


@dataclass(slots=True)
class EppConfig:
    host: str = "0.0.0.0"
    ext_proc_port: int = wire.EPP_EXT_PROC_PORT
    health_port: int = wire.EPP_HEALTH_PORT
    metrics_port: int = wire.EPP_METRICS_PORT
    endpoints: list[EndpointSpec] = field(default_factory=list)
    endpoints_file: str | None = None
    k8s_namespace: str | None = None
    k8s_selector: str = ""
    target_port: int = 8000
    kv_events_port: int | None = None  # the KV-event port convention (kvevents/sources.py)
    scrape_interval: float = 0.05
    scrape_timeout: float = 0.3
    scrape_idle_interval: float = 0.5  # idle endpoints' cadence (pool/scraper.py)
    stale_after: float = 2.0
    fail_threshold: int = 3
    scrape_timeout_grace: float = 5.0  # a timed-out scrape keeps the endpoint (pool/staleness.py)
    model: str = "demo"  # tokenizer source; "none" hashes bytes
    served_model_names: list[str] = field(default_factory=list)
    max_body_bytes: int = 4 * 1024 * 1024
    config: str | None = None  # scheduler YAML
    # Endpoints listed after the pick, for the gateway to retry on (0: the pick alone, which
    # any ORIGINAL_DST gateway understands; kvyard's gateway retries along the list).
    destination_fallbacks: int = 0
    pd_key_file: str | None = None  # the key that signs prefill targets (common/pd_auth.py)
    # Flow control (flow/controller.py); the TTLs override the config's flowControl section.
    flow_control: bool = True
    no_endpoint_ttl_s: float | None = None
    queue_ttl_s: float | None = None
    pool_name: str = "default"
    # KEDA's external scaler (scaler/server.py); None: not served (`kvyard epp` defaults to 9004).
    scaler_port: int | None = None
    seed: int | None = None
    # TLS for ext_proc and the scaler (tls.py); None: plaintext. A client CA: mutual TLS.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # Active-active replicas (replicas/): the pick pub/sub port (None: a lone EPP; 0: any
    # free pair, tests), the peers' pub ports, or a headless Service's name:port.
    replica_port: int | None = None
    peers: list[str] = field(default_factory=list)
    peers_dns: str | None = None
    catch_up_timeout_s: float = 5.0
    models_file: str | None = None  # several models and their pools (models.py)


def _flow_config(sched_cfg: dict, c: EppConfig) -> FlowConfig:
    fc = parse_flow_config(sched_cfg.get("flowControl"))
    if c.no_endpoint_ttl_s is not None:
        fc.no_endpoint_ttl_s = duration_s(c.no_endpoint_ttl_s, "--no-endpoint-ttl")
    if c.queue_ttl_s is not None:
        fc.default_ttl_s = duration_s(c.queue_ttl_s, "--queue-ttl")
    return fc


def _served_names(cfg: EppConfig) -> list[str]:
    if cfg.served_model_names:
        return list(cfg.served_model_names)
    if cfg.model.lower() == "none":
        return []
    try:
        from kvyard.common.models import resolve_model
        return [resolve_model(cfg.model).served_name]
    except Exception as e:  # noqa: BLE001 - serving any model beats not starting
        log.warning("cannot resolve --model %s (%s); accepting any model name", cfg.model, e)
        return []


def _kv_event_sources(sched: Scheduler, pool: EndpointPool, port: int | None,
                      subscribe: bool = True) -> KVEventSources | None:
    """The event streams behind the config's precise-prefix-cache scorers (one index,
    shared by every profile's); None when the config has none, or when `subscribe` is
    off: the built-in default config on an EPP without a tokenizer (--model none keys no
    request as the engine does, so the scorers' approximate fallback scores every endpoint;
    a config that names the scorer is followed as written)."""
    precise = [s for prof in sched.profiles.values() for s, _ in prof.scorers
               if isinstance(s, PrecisePrefixScorer)]
    if not precise or not subscribe:
        return None
    for s in precise[1:]:
        s.index = precise[0].index
    return KVEventSources(precise[0].index, pool, port)


@dataclass(slots=True)
class EppApp:
    cfg: EppConfig
    pool: EndpointPool = field(init=False)
    metrics: EppMetrics = field(init=False)
    director: Director = field(init=False)
    finisher: Finisher = field(init=False)
    eds: EdsServicer = field(init=False)
    demand: Demand = field(default_factory=Demand)
    flow: FlowController | None = field(init=False)
    scraper: Scraper | None = None
    timeout_grace: TimeoutGrace = field(init=False)
    tokenizers: dict[str, PromptHasher] = field(init=False)  # tokenizer source -> its hasher
    scaler: ScalerServer | None = field(init=False)
    kv_events: KVEventSources | None = field(init=False)  # with a precise-prefix-cache scorer
    replicas: PickBus | None = field(init=False)  # with --replica-port / --peers
    predictor: LatencyPredictor | None = field(init=False)  # with a latency scorer (slo/)
    tokenizer_state: str = "none"  # none | loading | loaded | failed
    draining: bool = False  # SIGTERM with replicas: readiness off before stopping (drain)
    servicer: ExtProcServicer | None = None  # ext_proc; calls `director`
    _grpc: grpc.aio.Server | None = None
    _health: HealthServer | None = None
    _web: web.AppRunner | None = None
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _k8s: K8sDiscovery | None = None
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.cfg
        self.pool = EndpointPool(stale_after=c.stale_after)
        self.metrics = EppMetrics()
        # never down before its metrics even count as stale
        self.timeout_grace = TimeoutGrace(max(c.scrape_timeout_grace, c.stale_after)
                                          if c.scrape_timeout_grace > 0 else 0.0)
        self.timeout_grace.register(self.metrics.registry)
        sched_cfg = load_config(c.config)
        if c.destination_fallbacks:
            sched_cfg = with_fallbacks(sched_cfg, c.destination_fallbacks)
        sched = build_scheduler(sched_cfg, seed=c.seed)
        self.pool.on_remove(sched.forget)
        self.kv_events = _kv_event_sources(sched, self.pool, c.kv_events_port,
                                           bool(c.config) or c.model.lower() != "none")
        if self.kv_events is not None:
            self.kv_events.register(self.metrics.registry)
        self.pool.on_remove(self.metrics.forget)
        self.finisher = Finisher(self.pool, sched)
        self.eds = EdsServicer(self.pool)
        self.pool.on_change(self.eds.notify)
        self.flow = None
        admission: Admission = SheddingAdmission(self.pool, sched)
        if c.flow_control:
            fc = _flow_config(sched_cfg, c)
            fm = FlowMetrics(self.metrics.registry, c.pool_name,
                             [*sched.objectives.values(), *fc.bands])
            admission = self.flow = FlowController(fc, self.pool, sched, self.demand, fm)
            self.pool.on_change(self._membership_changed)
        routes = ModelRoutes.load(c.models_file) if c.models_file else None
        latency = latency_scorers(sched)
        self.predictor = latency[0].predictor if latency else None
        if latency and latency[0].params.admission:
            admission = SloAdmission(admission)
        self.director = Director(self.pool, sched, PromptHasher(block_size=sched.block_size),
                                 admission, self.metrics, self.finisher,
                                 routes.names if routes else _served_names(c), routes=routes)
        # a hasher per tokenizer source: the EPP's, and those of pools tokenizing otherwise
        self.tokenizers = {c.model: self.director.hasher}
        if routes is not None and c.model.lower() != "none":
            for pool, source in routes.pool_tokenizers(c.model).items():
                self.director.pool_hashers[pool] = self.tokenizers.setdefault(
                    source, PromptHasher(block_size=sched.block_size))
        if self.predictor is not None:
            self.director.on_parse = annotator(self.predictor)
            self.metrics.registry.register(SloCollector(self.predictor))
        self.replicas = None
        if c.replica_port is not None or c.peers or c.peers_dns:
            self.replicas = PickBus(PickApplier(sched, self.pool),
                                    REPLICA_PORT if c.replica_port is None
                                    else c.replica_port, list(c.peers),
                                    DnsPeers.parse(c.peers_dns) if c.peers_dns else None,
                                    host=c.host, catch_up_timeout_s=c.catch_up_timeout_s)
            self.director.on_pick = self.replicas.record
            self.finisher.on_learn = self.replicas.learned
            self.director.stable_ties = True
        self.scaler = None
        if c.scaler_port is not None:
            self.scaler = ScalerServer(self.pool, self.demand, c.pool_name)
            self.scaler.register(self.metrics.registry)
            if self.predictor is not None:
                self.scaler.servicer.forecast = forecaster(self.predictor)

    def _membership_changed(self) -> None:
        """A joining endpoint is scraped at once, so the waiting room is released the
        moment it answers, not at the next scrape round."""
        if self.scraper is not None and self.scraper.running:
            self.scraper.round()
        if self.flow is not None:
            self.flow.release()

    def is_ready(self) -> bool:
        return (not self.draining
                and self.tokenizer_state in ("none", "loaded", "failed") and self.pool.ready()
                and (self.replicas is None or self.replicas.caught_up))

    def _debug(self) -> dict:
        h = self.director.hasher
        return {"tokenizer": self.tokenizer_state, "prefix_hash": h.mode,
                "served_models": self.director.served_models,
                "index_backlog": self.finisher.backlog, "index_skipped": self.finisher.skipped,
                "flow": self.flow.snapshot() if self.flow is not None else None,
                "kv_events": self.kv_events.snapshot() if self.kv_events is not None else None,
                "scaler": self.scaler.snapshot() if self.scaler is not None else None,
                "replicas": self.replicas.snapshot() if self.replicas is not None else None,
                "slo": self.predictor.snapshot() if self.predictor is not None else None}

    def _credentials(self) -> grpc.ServerCredentials | None:
        """One per server: each follows the files on its own (tls.py)."""
        c = self.cfg
        files = tls_files(c.tls_cert_file, c.tls_key_file, c.tls_client_ca_file)
        return None if files is None else files.credentials()

    async def start(self) -> None:
        c = self.cfg
        self._grpc = grpc.aio.server(options=SERVER_OPTIONS)
        self.servicer = ExtProcServicer(self.director, c.max_body_bytes,
                                        pd_auth.load_key(c.pd_key_file),
                                        None if self.predictor is None
                                        else Observer(self.predictor))
        ep_grpc.add_ExternalProcessorServicer_to_server(self.servicer, self._grpc)
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self.eds, self._grpc)
        self.ports["ext_proc"] = bind(self._grpc, c.host, c.ext_proc_port, "ext_proc",
                                      self._credentials())
        await self._grpc.start()
        self._health = HealthServer(c.health_port, self.is_ready, host=c.host)
        await self._health.start()
        self.ports["health"] = c.health_port
        self._web = web.AppRunner(debug_app(self.metrics, self.pool, self._debug),
                                  access_log=None)
        await self._web.setup()
        site = web.TCPSite(self._web, c.host, c.metrics_port)
        await site.start()
        self.ports["metrics"] = self._web.addresses[0][1]
        if self.scaler is not None:
            self.ports["scaler"] = await self.scaler.start(c.host, c.scaler_port,
                                                          self._credentials())
        if c.endpoints:
            self.pool.set_source("static", c.endpoints)
        if c.endpoints_file:
            fd = FileDiscovery(Path(c.endpoints_file), self.pool)
            fd.poll()
            self._tasks.append(asyncio.create_task(fd.run()))
        if c.k8s_namespace:
            self._k8s = K8sDiscovery(c.k8s_namespace, c.k8s_selector, c.target_port, self.pool,
                                     asyncio.get_running_loop())
            self._k8s.start()
        if self.replicas is not None:  # after discovery: snapshot picks name known endpoints
            await self.replicas.start()
            self.ports["replicas"] = self.replicas.port
        if self.kv_events is not None:  # discovery has run: subscribe, then follow changes
            self.kv_events.sync()
            self.pool.on_change(self.kv_events.sync)
        scraper = Scraper(self.pool, c.scrape_interval, c.scrape_timeout, c.fail_threshold,
                          # an idle endpoint's metrics must never go stale
                          idle_interval=min(c.scrape_idle_interval, c.stale_after / 2),
                          grace=self.timeout_grace)
        if self.flow is not None:
            scraper.on_scraped = self.flow.release
        if self.scaler is not None:
            scraper.observers.append(self.scaler.observe)
        self.scraper = scraper
        self._tasks.append(asyncio.create_task(scraper.run()))
        if c.model.lower() != "none":
            self.tokenizer_state = "loading"
            self._tasks.append(asyncio.create_task(self._load_tokenizer()))
        log.info("EPP serving: ext_proc :%d%s, health :%d, metrics :%d",
                 self.ports["ext_proc"], " (TLS)" if c.tls_cert_file else "", c.health_port,
                 self.ports["metrics"])

    async def _load_tokenizer(self) -> None:
        loaded = [await self._load_one(source, h) for source, h in self.tokenizers.items()]
        self.tokenizer_state = "loaded" if all(loaded) else "failed"

    async def _load_one(self, source: str, hasher: PromptHasher) -> bool:
        def load():
            from kvyard.common.tokenizer import ChatTemplateError, load_tokenizer
            return load_tokenizer(source), ChatTemplateError
        try:
            tok, err = await asyncio.get_running_loop().run_in_executor(None, load)
        except Exception as e:  # noqa: BLE001 - byte hashing still routes well
            log.error("tokenizer for %s failed to load (%s); hashing prompt bytes", source, e)
            return False
        hasher.set_tokenizer(tok, err)
        log.info("tokenizer for %s loaded", source)
        return True

    async def drain(self, notice_s: float = 1.0, grace_s: float = 3.0) -> None:
        """A replica's graceful exit, before `stop`: readiness NOT_SERVING at once (the
        health loop reports it within 0.1 s), `notice_s` for the gateway's health checks
        (every 0.5 s) to stop opening streams here, then the ext_proc listener closes and
        the streams still open get `grace_s` to finish. Whatever the gateway sends here
        meanwhile is still served; a stream cut at the end fails over (gateway/epp_failover.py)."""
        self.draining = True
        await asyncio.sleep(notice_s)
        if self._grpc is not None:
            await self._grpc.stop(grace_s)

    async def stop(self) -> None:
        if self.flow is not None:  # held requests get a clean 503, not a broken stream
            self.flow.close()
        if self._k8s is not None:
            self._k8s.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.replicas is not None:
            await self.replicas.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._health is not None:
            await self._health.stop()
        if self.scaler is not None:
            await self.scaler.stop()
        if self._grpc is not None:
            await self._grpc.stop(0.5)
        if self._web is not None:
            await self._web.cleanup()
        self.finisher.close()
