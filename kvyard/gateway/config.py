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
Deployment in Kubernetes, where two replicas avoid the gap altogether). With
replicas, that 503 is retried on another one by a second pass through the
gateway (`epp_failover.py`), so a replica dying mid-answer loses no request.

Error bodies: every reply Envoy makes itself (413 over the body limit, 503
with the EPP down, upstream connect failures) is rewritten by the local
reply mapper into OpenAI's `{"error": {message, type, param, code}}`; the
EPP's and workers' own JSON errors are recognised by their content type and
pass through untouched.
"""
from __future__ import annotations

import re
from typing import Any

from kvyard.common.wire import (DESTINATION_HEADER, OBSERVE_METADATA, ROUTING_HEADERS,
                                WORKERS_CLUSTER)
from kvyard.gateway import epp_failover
from kvyard.gateway.epp_cluster import epp_cluster, epp_grpc_service
from kvyard.gateway.spec import (EPP_CLUSTER, UNCAPPED, T, GatewayConfig, duration,
                                 socket_address, static_cluster)

__all__ = ["API_PATHS", "EPP_CLUSTER", "GatewayConfig", "HEALTH_PATH", "render", "render_yaml"]

def _workers_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    if cfg.direct_upstream:
        return static_cluster(WORKERS_CLUSTER, cfg.direct_upstream,
                               cfg.upstream_connect_timeout_s, http2=False)
    # Hosts from the EPP's EDS service (epp/xds.py); the EPP's answer picks among them,
    # in order (override host), so a retry goes to the next endpoint it listed.
    lb = T + "envoy.extensions.load_balancing_policies."
    return {
        "name": WORKERS_CLUSTER,
        "type": "EDS",
        "connect_timeout": duration(cfg.upstream_connect_timeout_s),
        # Envoy's default cap of 3 concurrent retries per cluster turns failover into
        # 503s: when a worker dies, every request on it or just routed to it retries at
        # once (each holds a slot from its back-off until the retried attempt answers),
        # and those past the third get the connect error instead. A retry only goes to
        # the next host the EPP listed, at most `upstream_retries` per request, so there
        # is no storm to guard against: at most one retry per request in flight.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT",
                                             "max_retries": UNCAPPED}]},
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


def _observe_filter(cfg: GatewayConfig) -> dict[str, Any]:
    """The EPP's second view of a request, for its SLO predictors (epp/slo/): the request
    headers (the EPP's FLIGHT_HEADER names the request it times) and the response's
    headers and streamed body, in observability mode: Envoy sends and never waits, so
    timing costs the response nothing, and a slow or absent EPP delays nothing."""
    svc = {**epp_grpc_service(cfg),
           "initial_metadata": [{"key": OBSERVE_METADATA, "value": "1"}]}
    return {"name": "kvyard.observe", "typed_config": {
        "@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": svc, "observability_mode": True, "failure_mode_allow": True,
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_header_mode": "SEND",
                            "response_body_mode": "STREAMED",
                            "response_trailer_mode": "SKIP"}}}


def _http_filters(cfg: GatewayConfig) -> list[dict[str, Any]]:
    # The buffer filter enforces the body limit (413) before the EPP sees anything,
    # and raises the stream's buffer limit so ext_proc's BUFFERED mode can hold it.
    filters: list[dict[str, Any]] = [{
        "name": "envoy.filters.http.buffer",
        "typed_config": {"@type": T + "envoy.extensions.filters.http.buffer.v3.Buffer",
                         "max_request_bytes": cfg.body_limit_bytes},
    }]
    if not cfg.direct_upstream:
        filters.append({
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": epp_grpc_service(cfg),
                "failure_mode_allow": False,
                "message_timeout": duration(cfg.ext_proc_timeout_s),
                "max_message_timeout": duration(max(cfg.max_hold_s, cfg.ext_proc_timeout_s)),
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
    if cfg.observe_responses and not cfg.direct_upstream:
        filters.append(_observe_filter(cfg))
    filters.append({"name": "envoy.filters.http.router",
                    "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"}})
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
                "@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True},
            "envoy.filters.http.buffer": {
                "@type": T + "envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
                "disabled": True}}


def _routes(cfg: GatewayConfig) -> list[dict[str, Any]]:
    upstream: dict[str, Any] = {"cluster": WORKERS_CLUSTER, "timeout": "0s",
                                "idle_timeout": duration(_idle_s(cfg))}
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
            "typed_config": {"@type": T + "envoy.extensions.access_loggers.filters.cel.v3."
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


def _epp_unavailable(cfg: GatewayConfig) -> dict[str, Any]:
    mapper = _local_reply("response.code_details.startsWith('ext_proc')", "server_error",
                          "endpoint_picker_unavailable",
                          "the endpoint picker is unavailable; retry shortly",
                          headers={"retry-after": "1"})
    # With replicas, a second pass retries it on another one (epp_failover.py).
    return epp_failover.mark_failures(mapper) if epp_failover.wanted(cfg) else mapper


def _local_replies(cfg: GatewayConfig) -> dict[str, Any]:
    """Every error Envoy itself answers gets OpenAI's error shape (first match wins)."""
    return {"mappers": [
        _local_reply("response.code == 413", "invalid_request_error", "request_too_large",
                     f"request body exceeds {cfg.body_limit_bytes} bytes"),
        # The EPP unreachable, failing or too slow: fail closed (see module docstring).
        _epp_unavailable(cfg),
        _local_reply("response.code == 404", "invalid_request_error", "not_found",
                     "%LOCAL_REPLY_BODY%"),
        _local_reply("response.code >= 500", "server_error", "gateway_error",
                     "%LOCAL_REPLY_BODY%"),
        _local_reply("response.code >= 400", "invalid_request_error", "bad_request",
                     "%LOCAL_REPLY_BODY%"),
    ]}


def _connection_manager(cfg: GatewayConfig) -> dict[str, Any]:
    early = {
        "name": "kvyard.strip_routing_headers",
        "typed_config": {
            "@type": T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": h} for h in ROUTING_HEADERS],
        },
    }
    return {
        "@type": T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvyard_gateway",
        "codec_type": "AUTO",
        "early_header_mutation_extensions": [early],
        "stream_idle_timeout": duration(_idle_s(cfg)),
        "request_timeout": "0s",
        "route_config": {
            "name": "kvyard",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": _routes(cfg)}],
        },
        "http_filters": _http_filters(cfg),
        "local_reply_config": _local_replies(cfg),
    }


def render(cfg: GatewayConfig) -> dict[str, Any]:
    """The full bootstrap as plain data (dump it as YAML or JSON)."""
    clusters = [_workers_cluster(cfg)]
    if not cfg.direct_upstream:
        clusters.append(epp_cluster(cfg))
    listener = {
        "name": "kvyard_gateway",
        "address": socket_address(f"{cfg.listen_address}:{cfg.listen_port}"),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": _connection_manager(cfg),
        }]}],
    }
    doc = {
        # xDS needs a node identity; the EPP serves every gateway the same pool.
        "node": {"id": f"kvyard-gateway-{cfg.listen_port}", "cluster": "kvyard-gateway"},
        "admin": {"address": socket_address(f"127.0.0.1:{cfg.admin_port}")},
        "static_resources": {"listeners": [listener], "clusters": clusters},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": T + "envoy.extensions.resource_monitors.downstream_connections.v3."
                              "DownstreamConnectionsConfig",
                "max_active_downstream_connections": cfg.max_connections,
            },
        }]},
    }
    return epp_failover.wrap(cfg, doc, _idle_s(cfg)) if epp_failover.wanted(cfg) else doc


def render_yaml(cfg: GatewayConfig) -> str:
    import yaml

    return yaml.safe_dump(render(cfg), sort_keys=False)
