"""A second pass through the gateway for requests whose EPP replica died mid-answer.

Why: with several EPP replicas, Envoy retries an ext_proc stream on another replica only
until the stream's response has started (`grpc_service.retry_policy`). The EPP answers a
request in two gRPC messages (the headers message's routing mutation, then the body's
continue: ext_proc needs one answer per message it sent), so a replica killed between
them, or while a held request waits, leaves a stream Envoy may not replay; the ext_proc
filter then fails the request closed with a 503 (`endpoint_picker_unavailable`). Under
load that was up to one request per client in flight at a SIGKILL.

How: the gateway's connection manager moves, unchanged, onto an *internal* listener
(Envoy's in-process listener, no socket), and the public port gets a thin one in front
that forwards every request to it with a route retry policy: a response carrying
`x-kvyard-epp-failed` (added by the inner local reply for exactly that 503) is retried
through the inner listener again, where ext_proc opens a fresh stream, balanced onto a
live replica (the dead one refuses connections and is ejected). Nothing else is retried
there: a worker's 503, a shed 429 or any error the EPP itself chose pass through at once,
and the header never reaches the client. The outer pass strips client routing headers as
the inner does, keeps no filters but the router, and buffers the body for the replay
(bounded by the same body limit). Failing open (`failure_mode_allow`) would instead send
such a request on without the EPP's checks and header stripping.
"""
from __future__ import annotations

import copy
from typing import Any

from kvyard.gateway.spec import UNCAPPED, T, GatewayConfig, duration

EPP_FAILED_HEADER = "x-kvyard-epp-failed"
INNER_LISTENER = "kvyard_gateway_inner"
INNER_CLUSTER = "kvyard_gateway_inner"


def wanted(cfg: GatewayConfig) -> bool:
    """Only with replicas to fail over to (one EPP: the retry would meet the same one)."""
    return (not cfg.direct_upstream and cfg.epp_stream_retries > 0
            and len(cfg.epp_addresses) > 1)


def mark_failures(mapper: dict[str, Any]) -> dict[str, Any]:
    """The ext_proc local reply mapper, also adding the header the outer pass retries on."""
    out = copy.deepcopy(mapper)
    out.setdefault("headers_to_add", []).append(
        {"header": {"key": EPP_FAILED_HEADER, "value": "1"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"})
    return out


def _outer_manager(cfg: GatewayConfig, inner: dict[str, Any], idle_s: float) -> dict[str, Any]:
    route = {
        "cluster": INNER_CLUSTER, "timeout": "0s", "idle_timeout": duration(idle_s),
        "retry_policy": {
            "retry_on": "retriable-headers",
            "retriable_headers": [{"name": EPP_FAILED_HEADER, "present_match": True}],
            "num_retries": cfg.epp_stream_retries,
            "retry_back_off": {"base_interval": "0.02s", "max_interval": "0.2s"}},
    }
    return {
        "@type": inner["@type"],
        "stat_prefix": "kvyard_gateway_outer",
        "codec_type": "AUTO",
        "early_header_mutation_extensions": inner["early_header_mutation_extensions"],
        "stream_idle_timeout": inner["stream_idle_timeout"],
        "request_timeout": "0s",
        "route_config": {
            "name": "kvyard_outer",
            "response_headers_to_remove": [EPP_FAILED_HEADER],
            "virtual_hosts": [{
                "name": "all", "domains": ["*"],
                # The replay needs the whole body; the inner buffer filter bounds it (413).
                "request_body_buffer_limit": cfg.body_limit_bytes,
                "routes": [{"match": {"prefix": "/"}, "route": route}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": T + "envoy.extensions.filters.http.router.v3.Router"}}],
        "local_reply_config": inner["local_reply_config"],
    }


def _inner_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    return {
        "name": INNER_CLUSTER,
        "connect_timeout": "1s",
        # Every retry is one more pass; the retry count per request bounds them.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_retries": UNCAPPED,
                                             "max_requests": UNCAPPED,
                                             "max_pending_requests": UNCAPPED,
                                             "max_connections": UNCAPPED}]},
        "per_connection_buffer_limit_bytes": cfg.body_limit_bytes + (1 << 20),
        "load_assignment": {"cluster_name": INNER_CLUSTER, "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"envoy_internal_address": {
                "server_listener_name": INNER_LISTENER}}}}]}]},
        "transport_socket": {"name": "envoy.transport_sockets.internal_upstream",
                             "typed_config": {
                                 "@type": T + "envoy.extensions.transport_sockets."
                                              "internal_upstream.v3.InternalUpstreamTransport",
                                 "transport_socket": {
                                     "name": "envoy.transport_sockets.raw_buffer",
                                     "typed_config": {
                                         "@type": T + "envoy.extensions.transport_sockets."
                                                      "raw_buffer.v3.RawBuffer"}}}},
    }


def wrap(cfg: GatewayConfig, bootstrap: dict[str, Any], idle_s: float) -> dict[str, Any]:
    """The bootstrap with its listener moved inside and the retrying pass in front. The
    inner listener stays first in the list (what reads "the gateway's listener" finds it)."""
    res = bootstrap["static_resources"]
    [public] = res["listeners"]
    hcm = public["filter_chains"][0]["filters"][0]["typed_config"]
    inner = {"name": INNER_LISTENER, "internal_listener": {},
             "per_connection_buffer_limit_bytes": cfg.body_limit_bytes + (1 << 20),
             "filter_chains": public["filter_chains"]}
    outer = {"name": public["name"], "address": public["address"],
             "filter_chains": [{"filters": [{
                 "name": "envoy.filters.network.http_connection_manager",
                 "typed_config": _outer_manager(cfg, hcm, idle_s)}]}]}
    res["listeners"] = [inner, outer]
    res["clusters"].append(_inner_cluster(cfg))
    bootstrap.setdefault("bootstrap_extensions", []).append({
        "name": "envoy.bootstrap.internal_listener",
        "typed_config": {"@type": T + "envoy.extensions.bootstrap.internal_listener.v3."
                                      "InternalListener"}})
    return bootstrap
