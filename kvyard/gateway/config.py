"""The Envoy bootstrap for kvyard's gateway, rendered from one small dataclass.

Envoy does the bytes (HTTP/1.1 and h2, streaming, limits); the EPP does the
choosing. The EPP sees every request over ext_proc and answers with
`x-gateway-destination-endpoint` (one endpoint, or an ordered list: the pick
then fallbacks). The workers cluster gets its hosts from the EPP's EDS
service and is balanced by Envoy's override-host policy, which sends the
request to the first listed host and each retry (connect failure, reset or
refused stream before the response starts) to the next; only pool members
can ever be reached. Five things matter for correctness and are easy to get
wrong, so they are spelled out here:

* Client-supplied routing headers are removed by the connection manager's
  *early* header mutation, which runs before any HTTP filter. A route-level
  `request_headers_to_remove` would run after ext_proc and delete the EPP's
  own answer.
* The upstream route only matches when the destination header is present:
  a request the EPP let through without a pick gets a 503, never a random
  worker.
* Only the API is exposed: the OpenAI routes, /tokenize, /detokenize and
  /v1/models go to the EPP; /health is Envoy's own 200; every other path (a
  worker's /metrics, its /health with the P/D peer endpoint, sleep, LoRA
  loading) is a 404 in OpenAI's shape that neither the EPP nor a worker sees.
  Those routes stay reachable pod to pod where the NetworkPolicies allow.
* Responses are never sent to the EPP and never buffered, and generation can
  be long, so the route has no overall timeout, only a stream idle timeout.
* Retries along the EPP's list are not capped cluster-wide: Envoy's default
  circuit breaker allows 3 concurrent retries, fewer than the requests a dying
  worker fails at once.

Body handling (checked with Envoy 1.40): the EPP answers the *headers*
message with its routing mutation, but only after it has read the body (it
routes on the prompt). In BUFFERED mode Envoy sends no body until the headers
are answered, a deadlock. So the request body is mode STREAMED with
`send_body_without_waiting_for_header_response`, behind a buffer filter: the
buffer filter holds the whole body (and enforces the limit with 413), so the
EPP receives it as exactly one chunk with end_of_stream, right after the
headers, and answers headers then body, in order.

Failure mode: closed. If the EPP is unreachable, fails, or answers slower
than `ext_proc_timeout_s`, Envoy answers 503 itself (code
`endpoint_picker_unavailable`, `retry-after: 1`). Failing open would not
help: the upstream route needs the EPP's pick (there is no destination to
fall back to), and routing around the EPP would skip shedding, prompt
validation and the P/D choice. OpenAI SDKs retry a 503 with backoff, and the
EPP is restarted within about a second (`kvyard up`'s supervisor, a
Deployment in Kubernetes, where two replicas avoid the gap altogether).

Error bodies: every reply Envoy makes itself (413 over the body limit, 503
with the EPP down, upstream connect failures) is rewritten by the local
reply mapper into OpenAI's `{"error": {message, type, param, code}}`; the
EPP's and workers' own JSON errors are recognised by their content type and
pass through untouched.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from kvyard.common.wire import DESTINATION_HEADER, MAX_HOLD_S, ROUTING_HEADERS, WORKERS_CLUSTER

_T = "type.googleapis.com/"
EPP_CLUSTER = "kvyard_epp"
_UNCAPPED = 2**32 - 1  # the largest circuit-breaker threshold Envoy takes (uint32)


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


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _socket_address(hostport: str) -> dict[str, Any]:
    host, _, port = hostport.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _static_cluster(name: str, hostport: str, connect_s: float, http2: bool) -> dict[str, Any]:
    # An IP is STATIC; a name (a Kubernetes Service: `<svc>.<ns>.svc`) is re-resolved by DNS.
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if _is_ip(hostport.rpartition(":")[0]) else "STRICT_DNS",
        "connect_timeout": _duration(connect_s),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(hostport)}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def _workers_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    if cfg.direct_upstream:
        return _static_cluster(WORKERS_CLUSTER, cfg.direct_upstream,
                               cfg.upstream_connect_timeout_s, http2=False)
    # Hosts from the EPP's EDS service (epp/xds.py); the EPP's answer picks among them,
    # in order (override host), so a retry goes to the next endpoint it listed.
    lb = _T + "envoy.extensions.load_balancing_policies."
    return {
        "name": WORKERS_CLUSTER,
        "type": "EDS",
        "connect_timeout": _duration(cfg.upstream_connect_timeout_s),
        # Envoy's default cap of 3 concurrent retries per cluster turns failover into
        # 503s: when a worker dies, every request on it or just routed to it retries at
        # once (each holds a slot from its back-off until the retried attempt answers),
        # and those past the third get the connect error instead. A retry only goes to
        # the next host the EPP listed, at most `upstream_retries` per request, so there
        # is no storm to guard against: at most one retry per request in flight.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT",
                                             "max_retries": _UNCAPPED}]},
        "eds_cluster_config": {"eds_config": {
            "resource_api_version": "V3",
            "api_config_source": {
                "api_type": "GRPC", "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": EPP_CLUSTER}}]}}},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": lb + "override_host.v3.OverrideHost",
                "override_host_sources": [{"header": DESTINATION_HEADER}],
                # Only when none of the listed hosts is known (EDS not caught up yet).
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.random",
                    "typed_config": {"@type": lb + "random.v3.Random"}}}]},
            }}}]},
    }


def _idle_s(cfg: GatewayConfig) -> float:
    """A held request has no activity until the EPP answers: the idle timeout outlasts a hold."""
    return max(cfg.stream_idle_timeout_s, cfg.max_hold_s + 30.0)


def _http_filters(cfg: GatewayConfig) -> list[dict[str, Any]]:
    # The buffer filter enforces the body limit (413) before the EPP sees anything,
    # and raises the stream's buffer limit so ext_proc's BUFFERED mode can hold it.
    filters: list[dict[str, Any]] = [{
        "name": "envoy.filters.http.buffer",
        "typed_config": {"@type": _T + "envoy.extensions.filters.http.buffer.v3.Buffer",
                         "max_request_bytes": cfg.body_limit_bytes},
    }]
    if not cfg.direct_upstream:
        filters.append({
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": _epp_grpc_service(cfg),
                "failure_mode_allow": False,
                "message_timeout": _duration(cfg.ext_proc_timeout_s),
                "max_message_timeout": _duration(max(cfg.max_hold_s, cfg.ext_proc_timeout_s)),
                "status_on_error": {"code": cfg.status_on_epp_error},
                "send_body_without_waiting_for_header_response": True,
                # Pinned with the EPP: headers and the whole body (one chunk, see above)
                # in, nothing out.
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "request_body_mode": "STREAMED",
                    "request_trailer_mode": "SKIP",
                    "response_header_mode": "SKIP",
                    "response_body_mode": "NONE",
                    "response_trailer_mode": "SKIP",
                },
            },
        })
    filters.append({"name": "envoy.filters.http.router",
                    "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}})
    return filters


# What the gateway exposes: the OpenAI API and the tokenizer routes. Everything else a
# worker serves (/metrics, /health with its P/D peer endpoint, sleep, version) is for the
# pods that need it, reached pod to pod, never through the entry point.
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize")
HEALTH_PATH = "/health"
_API_RE = "^(" + "|".join(re.escape(p) for p in API_PATHS) + ")"
_NOT_FOUND = ("not found: this gateway serves " + ", ".join(API_PATHS) + " and " + HEALTH_PATH)


def _local_only() -> dict[str, Any]:
    """Per-route: answered by Envoy itself, so neither the EPP nor the body buffer sees it."""
    return {"envoy.filters.http.ext_proc": {
                "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True},
            "envoy.filters.http.buffer": {
                "@type": _T + "envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
                "disabled": True}}


def _routes(cfg: GatewayConfig) -> list[dict[str, Any]]:
    upstream: dict[str, Any] = {"cluster": WORKERS_CLUSTER, "timeout": "0s",
                                "idle_timeout": _duration(_idle_s(cfg))}
    if cfg.direct_upstream:
        return [{"match": {"prefix": "/"}, "route": upstream}]
    # A request whose response has not started is retried on the EPP's next endpoint.
    upstream["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset",
                                "num_retries": cfg.upstream_retries}
    return [
        {"match": {"safe_regex": {"regex": _API_RE + "$"},
                   "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
         "route": upstream},
        # The gateway's own liveness, without a worker's internals.
        {"match": {"path": HEALTH_PATH}, "direct_response": {"status": 200},
         "typed_per_filter_config": _local_only()},
        # Any other path (the query string aside): 404 before the EPP sees it.
        {"match": {"prefix": "/", "headers": [{
            "name": ":path", "invert_match": True,
            "string_match": {"safe_regex": {"regex": _API_RE + r"(\?.*)?$"}}}]},
         "direct_response": {"status": 404, "body": {"inline_string": _NOT_FOUND}},
         "typed_per_filter_config": _local_only()},
        # Reached only if the EPP let an API request through without a pick.
        {"match": {"prefix": "/"},
         "direct_response": {"status": 503, "body": {"inline_string": "no endpoint picked"}}},
    ]


# Envoy's own replies (no content type set, or not JSON) are rewritten; the EPP's
# and the workers' JSON errors pass through untouched.
_NOT_JSON = ("!('content-type' in response.headers && "
             "response.headers['content-type'].startsWith('application/json'))")


def _local_reply(when: str, status_type: str, code: str, message: str,
                 headers: dict[str, str] | None = None) -> dict[str, Any]:
    mapper: dict[str, Any] = {
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": _T + "envoy.extensions.access_loggers.filters.cel.v3."
                                           "ExpressionFilter",
                             "expression": f"{_NOT_JSON} && ({when})"}}},
        "body_format_override": {"json_format": {"error": {
            "message": message, "type": status_type, "param": None, "code": code}}},
    }
    if headers:
        mapper["headers_to_add"] = [{"header": {"key": k, "value": v},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                                    for k, v in headers.items()]
    return mapper


def _local_replies(cfg: GatewayConfig) -> dict[str, Any]:
    """Every error Envoy itself answers gets OpenAI's error shape (first match wins)."""
    return {"mappers": [
        _local_reply("response.code == 413", "invalid_request_error", "request_too_large",
                     f"request body exceeds {cfg.body_limit_bytes} bytes"),
        # The EPP unreachable, failing or too slow: fail closed (see module docstring).
        _local_reply("response.code_details.startsWith('ext_proc')", "server_error",
                     "endpoint_picker_unavailable",
                     "the endpoint picker is unavailable; retry shortly",
                     headers={"retry-after": "1"}),
        _local_reply("response.code == 404", "invalid_request_error", "not_found",
                     "%LOCAL_REPLY_BODY%"),
        _local_reply("response.code >= 500", "server_error", "gateway_error",
                     "%LOCAL_REPLY_BODY%"),
        _local_reply("response.code >= 400", "invalid_request_error", "bad_request",
                     "%LOCAL_REPLY_BODY%"),
    ]}


def _epp_grpc_service(cfg: GatewayConfig) -> dict[str, Any]:
    svc: dict[str, Any] = {"envoy_grpc": {"cluster_name": EPP_CLUSTER},
                           "timeout": _duration(cfg.ext_proc_timeout_s)}
    if cfg.epp_stream_retries:
        svc["retry_policy"] = _epp_retry_policy(cfg)
    return svc


def _connection_manager(cfg: GatewayConfig) -> dict[str, Any]:
    early = {
        "name": "kvyard.strip_routing_headers",
        "typed_config": {
            "@type": _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": h} for h in ROUTING_HEADERS],
        },
    }
    return {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvyard_gateway",
        "codec_type": "AUTO",
        "early_header_mutation_extensions": [early],
        "stream_idle_timeout": _duration(_idle_s(cfg)),
        "request_timeout": "0s",
        "route_config": {
            "name": "kvyard",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": _routes(cfg)}],
        },
        "http_filters": _http_filters(cfg),
        "local_reply_config": _local_replies(cfg),
    }


def epp_tls_sni(cfg: GatewayConfig) -> str:
    return cfg.epp_tls_sni or cfg.epp_address.rpartition(":")[0].strip("[]")


def _epp_transport_socket(cfg: GatewayConfig) -> dict[str, Any]:
    """TLS to the EPP: its chain checked against the CA and its name against the SNI
    (Envoy checks no name unless told to); h2 by ALPN, as gRPC servers expect."""
    sni = epp_tls_sni(cfg)
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": cfg.epp_tls_ca_file},
            "match_typed_subject_alt_names": [{
                "san_type": "IP_ADDRESS" if _is_ip(sni) else "DNS",
                "matcher": {"exact": sni}}]}}
    if cfg.epp_tls_cert_file:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": cfg.epp_tls_cert_file},
            "private_key": {"filename": cfg.epp_tls_key_file}}]
    tls: dict[str, Any] = {
        "@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common}
    if not _is_ip(sni):  # SNI carries host names only
        tls["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def _epp_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    cluster = _static_cluster(EPP_CLUSTER, cfg.epp_address, cfg.epp_connect_timeout_s,
                              http2=True)
    hosts = cfg.epp_addresses or [cfg.epp_address]
    if len(hosts) > 1 or cfg.epp_health_ports:
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            _epp_host(h, _health_port(cfg, i)) for i, h in enumerate(hosts)]}]
    if cfg.epp_health_ports:
        # A replica is sent new streams only while it says `readiness` SERVING (it has
        # caught up with its peers); one failed check or a refused connection takes it out.
        cluster["health_checks"] = [{
            "timeout": _duration(cfg.epp_health_interval_s * 2),
            "interval": _duration(cfg.epp_health_interval_s),
            # Envoy's default re-checks a host without traffic once a minute: a replica
            # that was not ready at the first check would stay out that long.
            "no_traffic_interval": _duration(cfg.epp_health_interval_s),
            "no_traffic_healthy_interval": _duration(cfg.epp_health_interval_s),
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "always_log_health_check_failures": False,
            "grpc_health_check": {"service_name": "readiness"}}]
        cluster["outlier_detection"] = {"consecutive_local_origin_failure": 1,
                                        "split_external_local_origin_errors": True,
                                        "base_ejection_time": "5s",
                                        "max_ejection_percent": 50}
    if cfg.epp_stream_retries:
        # As on the workers' cluster: Envoy's default of 3 concurrent retries turns a dead
        # replica into 503s (every stream opened on it in the moment before it is ejected
        # retries at once); each stream retries at most epp_stream_retries times anyway.
        cluster["circuit_breakers"] = {"thresholds": [{"priority": "DEFAULT",
                                                       "max_retries": _UNCAPPED}]}
    if cfg.epp_tls_ca_file:
        cluster["transport_socket"] = _epp_transport_socket(cfg)
    return cluster


def _health_port(cfg: GatewayConfig, i: int) -> int | None:
    ports = cfg.epp_health_ports
    return None if not ports else ports[i] if len(ports) > 1 else ports[0]


def _epp_host(hostport: str, health_port: int | None) -> dict[str, Any]:
    ep: dict[str, Any] = {"address": _socket_address(hostport)}
    if health_port is not None:
        ep["health_check_config"] = {"port_value": health_port}
    return {"endpoint": ep}


def _epp_retry_policy(cfg: GatewayConfig) -> dict[str, Any]:
    """An ext_proc stream that fails before the EPP answered is opened again on another
    replica (never the same one twice)."""
    return {"retry_on": "connect-failure,refused-stream,reset,unavailable,cancelled",
            "num_retries": cfg.epp_stream_retries,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"},
            "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _T + "envoy.extensions.retry.host.previous_hosts."
                                               "v3.PreviousHostsPredicate"}}],
            "host_selection_retry_max_attempts": 3}


def render(cfg: GatewayConfig) -> dict[str, Any]:
    """The full bootstrap as plain data (dump it as YAML or JSON)."""
    clusters = [_workers_cluster(cfg)]
    if not cfg.direct_upstream:
        clusters.append(_epp_cluster(cfg))
    listener = {
        "name": "kvyard_gateway",
        "address": _socket_address(f"{cfg.listen_address}:{cfg.listen_port}"),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": _connection_manager(cfg),
        }]}],
    }
    return {
        # xDS needs a node identity; the EPP serves every gateway the same pool.
        "node": {"id": f"kvyard-gateway-{cfg.listen_port}", "cluster": "kvyard-gateway"},
        "admin": {"address": _socket_address(f"127.0.0.1:{cfg.admin_port}")},
        "static_resources": {"listeners": [listener], "clusters": clusters},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": _T + "envoy.extensions.resource_monitors.downstream_connections.v3."
                              "DownstreamConnectionsConfig",
                "max_active_downstream_connections": cfg.max_connections,
            },
        }]},
    }


def render_yaml(cfg: GatewayConfig) -> str:
    import yaml

    return yaml.safe_dump(render(cfg), sort_keys=False)
