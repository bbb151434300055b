"""The EPP's cluster in the gateway's bootstrap: one host or a replica per address,
gRPC health checks and stream retries across replicas, TLS to the EPP."""
from __future__ import annotations

from typing import Any

from kvyard.gateway.spec import (EPP_CLUSTER, UNCAPPED, T, GatewayConfig, duration, is_ip,
                                 socket_address, static_cluster)


def epp_grpc_service(cfg: GatewayConfig) -> dict[str, Any]:
    svc: dict[str, Any] = {"envoy_grpc": {"cluster_name": EPP_CLUSTER},
                           "timeout": duration(cfg.ext_proc_timeout_s)}
    if cfg.epp_stream_retries:
        svc["retry_policy"] = _epp_retry_policy(cfg)
    return svc


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
                "san_type": "IP_ADDRESS" if is_ip(sni) else "DNS",
                "matcher": {"exact": sni}}]}}
    if cfg.epp_tls_cert_file:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": cfg.epp_tls_cert_file},
            "private_key": {"filename": cfg.epp_tls_key_file}}]
    tls: dict[str, Any] = {
        "@type": T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common}
    if not is_ip(sni):  # SNI carries host names only
        tls["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def epp_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    cluster = static_cluster(EPP_CLUSTER, cfg.epp_address, cfg.epp_connect_timeout_s,
                              http2=True)
    hosts = cfg.epp_addresses or [cfg.epp_address]
    if len(hosts) > 1 or cfg.epp_health_ports:
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            _epp_host(h, _health_port(cfg, i)) for i, h in enumerate(hosts)]}]
    if cfg.epp_health_ports:
        # A replica is sent new streams only while it says `readiness` SERVING (it has
        # caught up with its peers); one failed check or a refused connection takes it out.
        cluster["health_checks"] = [{
            "timeout": duration(cfg.epp_health_interval_s * 2),
            "interval": duration(cfg.epp_health_interval_s),
            # Envoy's default re-checks a host without traffic once a minute: a replica
            # that was not ready at the first check would stay out that long.
            "no_traffic_interval": duration(cfg.epp_health_interval_s),
            "no_traffic_healthy_interval": duration(cfg.epp_health_interval_s),
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
                                                       "max_retries": UNCAPPED}]}
    if cfg.epp_tls_ca_file:
        cluster["transport_socket"] = _epp_transport_socket(cfg)
    return cluster


def _health_port(cfg: GatewayConfig, i: int) -> int | None:
    ports = cfg.epp_health_ports
    return None if not ports else ports[i] if len(ports) > 1 else ports[0]


def _epp_host(hostport: str, health_port: int | None) -> dict[str, Any]:
    ep: dict[str, Any] = {"address": socket_address(hostport)}
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
                "typed_config": {"@type": T + "envoy.extensions.retry.host.previous_hosts."
                                               "v3.PreviousHostsPredicate"}}],
            "host_selection_retry_max_attempts": 3}
