"""`kvyard gateway-config`: print the Envoy bootstrap kvyard's gateway runs with,
so the same config can be inspected, diffed or mounted into a pod."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8080, help="gateway listen port")
    p.add_argument("--listen-address", default="127.0.0.1")
    p.add_argument("--epp", default="127.0.0.1:9002", help="EPP ext_proc address host:port")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port (127.0.0.1 only)")
    p.add_argument("--body-limit", type=int, default=4 * 1024 * 1024,
                   help="largest request body in bytes; larger gets 413")
    p.add_argument("--ext-proc-timeout", type=float, default=5.0, help="seconds per EPP answer")
    p.add_argument("--stream-idle-timeout", type=float, default=300.0)
    p.add_argument("--epp-tls-ca", default=None, metavar="FILE",
                   help="reach the EPP over TLS: the CA its certificate chains to")
    p.add_argument("--epp-tls-sni", default=None, metavar="NAME",
                   help="SNI and the name the EPP's certificate must carry (default: --epp's host)")
    p.add_argument("--epp-tls-cert", default=None, metavar="FILE",
                   help="Envoy's client certificate, for an EPP with mutual TLS")
    p.add_argument("--epp-tls-key", default=None, metavar="FILE", help="its private key")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")


def run(args: argparse.Namespace) -> int:
    from kvyard.gateway.config import GatewayConfig, render, render_yaml

    cfg = GatewayConfig(listen_port=args.port, listen_address=args.listen_address,
                        epp_address=args.epp, admin_port=args.admin_port,
                        body_limit_bytes=args.body_limit, ext_proc_timeout_s=args.ext_proc_timeout,
                        stream_idle_timeout_s=args.stream_idle_timeout,
                        epp_tls_ca_file=args.epp_tls_ca, epp_tls_sni=args.epp_tls_sni,
                        epp_tls_cert_file=args.epp_tls_cert, epp_tls_key_file=args.epp_tls_key)
    tls_options = (cfg.epp_tls_sni, cfg.epp_tls_cert_file, cfg.epp_tls_key_file)
    if any(tls_options) and not cfg.epp_tls_ca_file:
        raise SystemExit("kvyard gateway-config: --epp-tls-* need --epp-tls-ca")
    if bool(cfg.epp_tls_cert_file) != bool(cfg.epp_tls_key_file):
        raise SystemExit("kvyard gateway-config: --epp-tls-cert and --epp-tls-key go together")
    print(json.dumps(render(cfg), indent=2) if args.format == "json" else render_yaml(cfg), end="")
    return 0
