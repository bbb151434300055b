"""The rendered Envoy bootstrap: accepted by the real Envoy binary, and shaped so
that routing headers cannot be forged and the EPP's answer is what routes."""
from __future__ import annotations

import subprocess
from pathlib import Path

from kvyard.common.wire import (DESTINATION_HEADER, PREFILLER_AUTH_HEADER, PREFILLER_HEADER,
                                 WORKERS_CLUSTER)
from kvyard.gateway.config import GatewayConfig, render
from kvyard.gateway.envoy import envoy_binary, write_config


def _hcm(doc: dict) -> dict:
    return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _validate(cfg: GatewayConfig, tmp_path: Path) -> subprocess.CompletedProcess:
    conf = write_config(cfg, tmp_path / "envoy.yaml")
    return subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(conf), "-l", "error"],
                          capture_output=True, text=True, timeout=60)


def test_envoy_accepts_both_configs(tmp_path: Path) -> None:
    for cfg in (GatewayConfig(listen_port=18080, admin_port=19901),
                GatewayConfig(listen_port=18080, admin_port=19901, direct_upstream="127.0.0.1:8100")):
        r = _validate(cfg, tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "OK" in r.stdout


def test_envoy_rejects_a_broken_config(tmp_path: Path) -> None:
    # Guards the test above: validation really parses what we render.
    bad = tmp_path / "bad.yaml"
    bad.write_text("static_resources: {clusters: [{name: x, type: NOPE}]}\n")
    r = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


def test_routing_headers_are_stripped_before_any_filter() -> None:
    hcm = _hcm(render(GatewayConfig()))
    removed = [m["remove"] for ext in hcm["early_header_mutation_extensions"]
               for m in ext["typed_config"]["mutations"]]
    assert set(removed) == {DESTINATION_HEADER, PREFILLER_HEADER, PREFILLER_AUTH_HEADER}
    # A route-level removal would run after ext_proc and delete the EPP's answer.
    for vh in hcm["route_config"]["virtual_hosts"]:
        assert "request_headers_to_remove" not in vh
        for r in vh["routes"]:
            assert "request_headers_to_remove" not in r.get("route", {})


def test_ext_proc_mode_is_pinned_and_fails_closed() -> None:
    hcm = _hcm(render(GatewayConfig(epp_address="127.0.0.1:19002")))
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.buffer", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.router"]
    ext = hcm["http_filters"][1]["typed_config"]
    assert ext["failure_mode_allow"] is False
    # The EPP answers headers only after reading the body: Envoy must not wait.
    assert ext["processing_mode"]["request_body_mode"] == "STREAMED"
    assert ext["send_body_without_waiting_for_header_response"] is True
    assert ext["processing_mode"]["response_header_mode"] == "SKIP"
    assert ext["processing_mode"]["response_body_mode"] == "NONE"
    epp = [c for c in render(GatewayConfig())["static_resources"]["clusters"] if c["name"] == "kvyard_epp"]
    assert "http2_protocol_options" in str(epp[0])


def test_upstream_route_needs_the_epp_pick() -> None:
    routes = _hcm(render(GatewayConfig()))["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"]["headers"] == [{"name": DESTINATION_HEADER, "present_match": True}]
    assert routes[0]["route"]["timeout"] == "0s"  # generation may take minutes
    assert routes[-1]["direct_response"]["status"] == 503  # never ORIGINAL_DST to ourselves


def test_cli_prints_the_config() -> None:
    import sys

    out = subprocess.run([sys.executable, "-m", "kvyard.cli", "gateway-config", "--port", "18123",
                          "--format", "json"], capture_output=True, text=True, timeout=60, check=True)
    assert '"port_value": 18123' in out.stdout


def test_failover_retries_are_not_capped_cluster_wide() -> None:
    # Envoy's default allows 3 concurrent retries per cluster: a worker dying under
    # load fails over more requests than that at once, and the rest would get 503s.
    workers = render(GatewayConfig())["static_resources"]["clusters"][0]
    assert workers["name"] == WORKERS_CLUSTER
    (default,) = [t for t in workers["circuit_breakers"]["thresholds"]
                  if t["priority"] == "DEFAULT"]
    assert default["max_retries"] >= GatewayConfig().max_connections
