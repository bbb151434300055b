"""The gateway's settings (`GatewayConfig`) and the small Envoy-JSON helpers the
bootstrap's parts share (config.py renders the whole; epp_cluster.py the EPP's cluster)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from kvyard.common.wire import MAX_HOLD_S

T = "type.googleapis.com/"
EPP_CLUSTER = "kvyard_epp"
UNCAPPED = 2**32 - 1  # the largest circuit-breaker threshold Envoy takes (uint32)


@dataclass(slots=True)
class GatewayConfig:
    """Everything that varies between a laptop stack, tests and a pod."""

    listen_port: int = 8080
    listen_address: str = "127.0.0.1"
    epp_address: str = "127.0.0.1:9002"
    admin_port: int = 9901
    # Largest request body accepted; above it Envoy answers 413 itself.
    body_limit_bytes: int = 4 * 1024 * 1024
    # How long Envoy waits for one EPP answer; a 50k-token prompt must fit.
    ext_proc_timeout_s: float = 5.0
    # The longest the EPP may hold a request (its waiting room and flow-control queues):
    # while it holds one it extends Envoy's per-message timeout up to this, in
    # `override_message_timeout` answers; a silent EPP still fails at ext_proc_timeout_s.
    max_hold_s: float = MAX_HOLD_S
    # Generation can run for minutes, but a silent stream is dead. A request the EPP
    # holds is silent too: the stream idle timeout covers the longest hold.
    stream_idle_timeout_s: float = 300.0
    upstream_connect_timeout_s: float = 2.0
    # Retries on the EPP's fallback endpoints (connect failure or reset before a response).
    upstream_retries: int = 2
    epp_connect_timeout_s: float = 1.0
    # Status Envoy returns when the EPP is unreachable or errors (fail closed).
    status_on_epp_error: int = 503
    # Cap on open client connections, so a flood cannot exhaust file descriptors.
    max_connections: int = 20000
    # A fixed upstream instead of the EPP: the baseline for `kvyard bench epp`.
    direct_upstream: str | None = None
    # TLS to the EPP (ext_proc and EDS): the CA its certificate must chain to; None: plaintext.
    epp_tls_ca_file: str | None = None
    # The name sent as SNI and required among the certificate's DNS names; None: the
    # host of epp_address (in a pod, the EPP Service's name).
    epp_tls_sni: str | None = None
    # Envoy's own certificate, for an EPP that asks for one (mutual TLS).
    epp_tls_cert_file: str | None = None
    epp_tls_key_file: str | None = None
    # Active-active EPP replicas (epp/replicas/): every replica's ext_proc address (empty:
    # epp_address alone). Envoy balances ext_proc streams over them.
    epp_addresses: list[str] = field(default_factory=list)
    # The replicas' gRPC health ports, one per address (or one for all: a Service name);
    # set, Envoy checks each replica's `readiness` and sends new streams only to ready ones.
    epp_health_ports: list[int] = field(default_factory=list)
    epp_health_interval_s: float = 0.5
    # Retries of an ext_proc stream that fails before any answer (connect failure, reset,
    # UNAVAILABLE) on another replica; 0: none (one EPP has no other host to try).
    epp_stream_retries: int = 0
    # A second, observe-only ext_proc filter: the EPP gets each timed request's response
    # headers and streamed body without Envoy waiting (its latency scorer learns TTFT and
    # TPOT from them, epp/slo/); off, the EPP sees requests only.
    observe_responses: bool = False


def duration(seconds: float) -> str:
    return f"{seconds:g}s"


def socket_address(hostport: str) -> dict[str, Any]:
    host, _, port = hostport.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def static_cluster(name: str, hostport: str, connect_s: float, http2: bool) -> dict[str, Any]:
    # An IP is STATIC; a name (a Kubernetes Service: `<svc>.<ns>.svc`) is re-resolved by DNS.
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if is_ip(hostport.rpartition(":")[0]) else "STRICT_DNS",
        "connect_timeout": duration(connect_s),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(hostport)}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster
