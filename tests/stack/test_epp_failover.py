"""Losing an EPP replica under load loses no request: a SIGKILL between the replica's
two ext_proc answers (which Envoy's stream retry cannot replay) is retried through the
gateway's second pass on the live replica (kvyard/gateway/epp_failover.py), and a SIGTERM
drains (readiness off, open streams finished) before the replica exits."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvyard.stack.launch import start_stack

from .conftest import envoy_validates, make_spec


@pytest.mark.parametrize("victim,sig", [("epp-1", signal.SIGKILL), ("epp", signal.SIGTERM)])
def test_no_request_is_lost_when_a_replica_goes(tmp_path: Path, h, wait_until, victim: str,
                                                sig: signal.Signals) -> None:
    spec = make_spec(tmp_path / "s", 3)
    spec.epp_replicas = 2
    bodies: list = []
    at, results = h.signal_under_load(start_stack(spec), victim, sig, 8, wait_until, timeout=20, bodies=bodies)
    failed = [s for _, s in results if s != 200]
    # seconds from the signal, status and body of the first failures: what failed, and when
    assert failed == [], (len(failed), len(results), [(round(t - at, 3), st, b) for t, st, b in bodies[:5]])
    assert len(results) >= 120


def test_the_failover_pass_is_rendered_only_with_replicas(tmp_path: Path) -> None:
    import yaml

    from kvyard.gateway.config import GatewayConfig, render_yaml
    from kvyard.gateway.epp_failover import EPP_FAILED_HEADER, INNER_CLUSTER, INNER_LISTENER

    cfg = GatewayConfig(listen_port=18080, epp_address="127.0.0.1:19002",
                        epp_addresses=["127.0.0.1:19002", "127.0.0.1:19012"],
                        epp_health_ports=[19003, 19013], epp_stream_retries=1)
    text = render_yaml(cfg)
    doc = yaml.safe_load(text)
    inner, outer = doc["static_resources"]["listeners"]
    assert inner["name"] == INNER_LISTENER and "internal_listener" in inner
    assert outer["address"]["socket_address"]["port_value"] == 18080
    hcm = outer["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    assert hcm["early_header_mutation_extensions"]  # client routing headers stripped here too
    rc = hcm["route_config"]
    assert rc["response_headers_to_remove"] == [EPP_FAILED_HEADER]
    route = rc["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == INNER_CLUSTER
    assert route["retry_policy"]["retriable_headers"][0]["name"] == EPP_FAILED_HEADER
    assert route["retry_policy"]["retry_on"] == "retriable-headers"  # nothing else retried
    inner_hcm = inner["filter_chains"][0]["filters"][0]["typed_config"]
    marked = [m for m in inner_hcm["local_reply_config"]["mappers"]
              if any(x["header"]["key"] == EPP_FAILED_HEADER for x in m.get("headers_to_add", []))]
    assert len(marked) == 1 and "ext_proc" in str(marked[0]["filter"])
    envoy_validates(text, tmp_path)
    one = yaml.safe_load(render_yaml(GatewayConfig(epp_address="127.0.0.1:19002")))
    assert len(one["static_resources"]["listeners"]) == 1
    assert EPP_FAILED_HEADER not in yaml.safe_dump(one)
