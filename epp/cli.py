"""`kvyard epp`: run the Endpoint Picker.

Heavy imports (grpc, protobuf classes, aiohttp) happen in `run`, so
`kvyard --help` stays instant; nothing here ever imports torch.
"""
from __future__ import annotations

import argparse
import sys

from kvyard.common import wire


def _endpoint(value: str):
    from .pool.endpoints import parse_spec
    addr, _, role = value.partition("=")
    try:
        return parse_spec({"address": addr, "role": role or "both"})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _peers(value: str) -> list[str]:
    from .replicas.peers import parse_peers
    try:
        return parse_peers(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _peers_dns(value: str) -> str:
    from .replicas.peers import DnsPeers
    try:
        DnsPeers.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ports")
    g.add_argument("--host", default="0.0.0.0", help="bind address for all the servers")
    g.add_argument("--ext-proc-port", type=int, default=wire.EPP_EXT_PROC_PORT)
    g.add_argument("--health-port", type=int, default=wire.EPP_HEALTH_PORT)
    g.add_argument("--metrics-port", type=int, default=wire.EPP_METRICS_PORT,
                   help="Prometheus /metrics and /debug/endpoints")
    g.add_argument("--scaler-port", type=int, default=wire.EPP_SCALER_PORT,
                   help="KEDA's external scaler (gRPC externalscaler.ExternalScaler); -1: off")
    g = p.add_argument_group("TLS (ext_proc and the scaler; the health port stays plaintext)")
    g.add_argument("--tls-cert-file", default=None,
                   help="PEM certificate chain: serve ext_proc and the scaler over TLS (the files "
                        "are read again when they change)")
    g.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    g.add_argument("--tls-client-ca-file", default=None,
                   help="PEM CA: clients must present a certificate it signed (mutual TLS)")
    g = p.add_argument_group("endpoints")
    g.add_argument("--endpoint", action="append", default=[], type=_endpoint,
                   metavar="IP:PORT[=ROLE]", help="a fixed endpoint (repeatable)")
    g.add_argument("--endpoints-file", help="YAML list of {address, role}; reloaded on change")
    g.add_argument("--k8s-namespace", help="watch Ready pods in this namespace")
    g.add_argument("--k8s-selector", default="", help="pod label selector key=value,...")
    g.add_argument("--target-port", type=int, default=8000, help="worker port on each pod")
    g.add_argument("--kv-events-port", type=int, default=None, metavar="PORT",
                   help="endpoints that name no KV-event stream publish on tcp://<host>:PORT "
                        "(replay PORT+1); read by the precise-prefix-cache scorer")
    g = p.add_argument_group("scraping")
    g.add_argument("--scrape-interval", type=float, default=0.05, help="seconds")
    g.add_argument("--scrape-timeout", type=float, default=0.3, help="seconds")
    g.add_argument("--scrape-idle-interval", type=float, default=0.5,
                   help="seconds between scrapes of an idle endpoint (nothing waiting, running "
                        "or just picked); at most half of --stale-after")
    g.add_argument("--stale-after", type=float, default=2.0, help="seconds")
    g.add_argument("--fail-threshold", type=int, default=3,
                   help="failed scrapes in a row before an endpoint gets no traffic")
    g.add_argument("--scrape-timeout-grace", type=float, default=5.0, metavar="SECONDS",
                   help="an endpoint whose scrapes time out stays routable on its last metrics "
                        "this long after its last good scrape (a busy pod, not a dead one; a "
                        "refused connection is down at once; at least --stale-after); 0: "
                        "timeouts count as failures, as --fail-threshold says")
    g = p.add_argument_group("requests")
    g.add_argument("--model", default="demo",
                   help="tokenizer source: demo, a .gguf or a HF dir; 'none' hashes bytes")
    g.add_argument("--served-model-name", action="append", default=[],
                   help="model name(s) clients may ask for (default: the --model's name)")
    g.add_argument("--models-file", default=None, metavar="YAML",
                   help="several models: each base model's pool and its LoRA adapters "
                        "(epp/models.py); requests go to their model's pool, /v1/models lists all")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    g.add_argument("--config", help="scheduler YAML (filters, scorers, weights, objectives)")
    g.add_argument("--destination-fallbacks", type=int, default=0, metavar="N",
                   help="list N more endpoints after the pick in x-gateway-destination-endpoint, "
                        "for a gateway that retries along the list (kvyard's does; default 0)")
    g.add_argument("--pd-key-file", default=None,
                   help="key shared with the workers that signs x-prefiller-host-port "
                        "(default: $KVYARD_PD_KEY_FILE; without one, P/D targets are unsigned "
                        "and kvyard workers refuse them)")
    g.add_argument("--seed", type=int, default=None, help="tie-break RNG seed")
    g = p.add_argument_group("flow control (the config's flowControl section; flow/controller.py)")
    g.add_argument("--pool-name", default="default",
                   help="this EPP's pool, as metrics and the KEDA scaler's `pool` name it")
    g.add_argument("--no-endpoint-ttl", type=float, default=None, metavar="SECONDS",
                   help="longest a request waits for a ready endpoint (the waiting room, a cold "
                        "start; default 300) before a 503")
    g.add_argument("--queue-ttl", type=float, default=None, metavar="SECONDS",
                   help="longest a request waits in a saturated pool's queue (default 60) "
                        "before a 429")
    g.add_argument("--no-flow-control", action="store_true",
                   help="hold nothing: 503 at once with no endpoint, as a plain router")
    g = p.add_argument_group("active-active replicas (replicas/: picks shared between EPPs)")
    g.add_argument("--replica-port", type=int, default=None, metavar="PORT",
                   help="publish this replica's picks on PORT (snapshots on PORT+1; default "
                        "9005 once --peers or --peers-dns is given)")
    g.add_argument("--peers", default=[], type=_peers, metavar="HOST:PORT,...",
                   help="the other replicas' --replica-port (a list including this one is fine)")
    g.add_argument("--peers-dns", default=None, type=_peers_dns, metavar="NAME:PORT",
                   help="a headless Service of the EPP pods: every A record is a peer")
    g.add_argument("--catch-up-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="longest a starting replica waits for a peer's recent picks before "
                        "reporting ready")
    p.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace):
    from .app import EppConfig
    from .pool.discovery_k8s import selector_string
    return EppConfig(
        host=args.host, ext_proc_port=args.ext_proc_port, health_port=args.health_port,
        metrics_port=args.metrics_port, endpoints=list(args.endpoint),
        endpoints_file=args.endpoints_file, k8s_namespace=args.k8s_namespace,
        k8s_selector=selector_string(args.k8s_selector), target_port=args.target_port,
        kv_events_port=args.kv_events_port,
        scrape_interval=args.scrape_interval, scrape_timeout=args.scrape_timeout,
        scrape_idle_interval=args.scrape_idle_interval,
        stale_after=args.stale_after, fail_threshold=args.fail_threshold, model=args.model,
        scrape_timeout_grace=args.scrape_timeout_grace,
        served_model_names=list(args.served_model_name), max_body_bytes=args.max_body_bytes,
        config=args.config, seed=args.seed, models_file=args.models_file, destination_fallbacks=args.destination_fallbacks,
        pd_key_file=args.pd_key_file, pool_name=args.pool_name,
        scaler_port=None if args.scaler_port < 0 else args.scaler_port,
        no_endpoint_ttl_s=args.no_endpoint_ttl, queue_ttl_s=args.queue_ttl,
        flow_control=not args.no_flow_control, tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file, tls_client_ca_file=args.tls_client_ca_file,
        replica_port=args.replica_port, peers=list(args.peers),
        peers_dns=args.peers_dns, catch_up_timeout_s=args.catch_up_timeout)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from .app import EppApp

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .scheduling.plugin_config import ConfigError

    try:
        app = EppApp(config_from_args(args))
    except (ConfigError, OSError) as e:  # a bad --config: say where, don't start
        print(f"kvyard epp: bad scheduler config {args.config}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a bad --models-file
        print(f"kvyard epp: bad --models-file {args.models_file}: {e}", file=sys.stderr)
        return 2
    from .tls import tls_files
    try:
        tls_files(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    except ValueError as e:
        print(f"kvyard epp: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        await app.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            if app.replicas is not None:  # peers take over while this one drains
                await app.drain()
        finally:
            await app.stop()

    asyncio.run(main())
    return 0
