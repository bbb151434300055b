"""Active-active EPP replicas in a real local stack: `kvyard up --sim 4 --epp-replicas 2`
serves through Envoy and `kvyard status --json` lists both EPPs; SIGKILLing one EPP
under load costs no request (Envoy health-checks the replicas and retries an ext_proc
stream that failed on the dead one on the other)."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from kvyard.stack import procs
from kvyard.stack.launch import start_stack
from kvyard.stack.state import StackState

from .conftest import envoy_validates, make_spec


def test_up_sim_with_two_epp_replicas_serves_and_status_lists_both(tmp_path: Path, h) -> None:
    rd = tmp_path / "run"
    done = h.kvyard("up", "--sim", "4", "--epp-replicas", "2", "--port", str(procs.free_port()),
                    "--run-dir", str(rd))
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        state = StackState.load(rd)
        assert [p.name for p in state.procs if p.name.startswith("epp")] == ["epp", "epp-1"]
        for i in range(6):
            r = h.request(state.gateway_url, h.chat_body(f"replicas {i}"), timeout=30)
            assert r.status == 200, r.body
        st = h.kvyard("status", "--json", "--run-dir", str(rd))
        assert st.returncode == 0, st.stderr
        epps = json.loads(st.stdout)["epps"]
        assert [e["name"] for e in epps] == ["epp", "epp-1"]
        assert all(e["running"] and e["answers"] and e["replicas"]["caught_up"] for e in epps)
        assert sum(e["replicas"]["sent"] for e in epps) >= 6  # every pick was shared
    finally:
        down = h.kvyard("down", "--run-dir", str(rd))
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.mark.parametrize("victim", ["epp", "epp-1"])  # "epp" also serves Envoy's EDS
def test_an_epp_replica_killed_under_load_costs_no_request(tmp_path: Path, h, wait_until,
                                                           victim: str) -> None:
    """Every request that starts after the kill succeeds: a new ext_proc stream opened on
    the dead replica (before Envoy ejects it) is retried on the live one. A request whose
    stream the dead replica had already begun answering cannot be retried (Envoy retries a
    stream only before its first response) and gets the retryable 503: at most one per
    client in flight at the kill, usually none."""
    spec = make_spec(tmp_path / "s", 3)
    spec.epp_replicas = 2
    clients = 4
    killed_at, results = h.signal_under_load(start_stack(spec), victim, signal.SIGKILL,
                                             clients, wait_until)
    failed = [(t0 - killed_at, s) for t0, s in results if s != 200]
    assert all(t < 0 and s == 503 for t, s in failed), failed  # only those in flight
    assert len(failed) <= clients, failed


def test_the_local_gateway_lists_every_replica_health_checked_with_stream_retries(
        tmp_path: Path) -> None:
    import yaml

    from kvyard.gateway.config import EPP_CLUSTER, GatewayConfig, render_yaml

    cfg = GatewayConfig(epp_address="127.0.0.1:19002",
                        epp_addresses=["127.0.0.1:19002", "127.0.0.1:19012"],
                        epp_health_ports=[19003, 19013], epp_stream_retries=1)
    text = render_yaml(cfg)
    doc = yaml.safe_load(text)
    cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == EPP_CLUSTER)
    hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [(h["endpoint"]["address"]["socket_address"]["port_value"],
             h["endpoint"]["health_check_config"]["port_value"]) for h in hosts] == \
        [(19002, 19003), (19012, 19013)]
    assert cluster["type"] == "STATIC"
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == "readiness"
    ext = _ext_proc(doc)
    assert ext["failure_mode_allow"] is False  # still fail closed when no replica answers
    assert ext["grpc_service"]["retry_policy"]["num_retries"] == 1
    envoy_validates(text, tmp_path)
    one = yaml.safe_load(render_yaml(GatewayConfig(epp_address="127.0.0.1:19002")))
    single = next(c for c in one["static_resources"]["clusters"] if c["name"] == EPP_CLUSTER)
    assert "health_checks" not in single and "outlier_detection" not in single
    assert "retry_policy" not in _ext_proc(one)["grpc_service"]


def _ext_proc(doc: dict) -> dict:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return next(f for f in hcm["typed_config"]["http_filters"]
                if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
