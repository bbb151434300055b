"""Endpoint discovery: the static file (reloaded live) and Kubernetes pods."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus

from kvyard.epp.pool.discovery_file import FileDiscovery
from kvyard.epp.pool.discovery_k8s import pod_endpoint, selector_string
from kvyard.epp.pool.endpoints import EndpointPool, EndpointSpec, parse_spec


async def test_file_reload_adds_and_removes_endpoints(epp, xp, tmp_path):
    f = tmp_path / "endpoints.yaml"
    f.write_text("endpoints:\n  - {address: 127.0.0.1:1001, role: decode}\n  - 127.0.0.1:1002\n")
    app = await epp(endpoints_file=str(f))
    assert {e.address for e in app.pool.all()} == {"127.0.0.1:1001", "127.0.0.1:1002"}
    assert app.pool.get("127.0.0.1:1001").role == "decode"
    f.write_text("- {address: 127.0.0.1:1002, role: prefill}\n- 127.0.0.1:1003\n")
    await xp.wait_for(lambda: {e.address for e in app.pool.all()} ==
                      {"127.0.0.1:1002", "127.0.0.1:1003"}, what="reload")
    assert app.pool.get("127.0.0.1:1002").role == "prefill"
    f.write_text("endpoints: []\n")
    await xp.wait_for(lambda: len(app.pool) == 0, what="emptied")


def test_broken_or_missing_file_keeps_the_last_good_list(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text("- 127.0.0.1:1\n")
    pool = EndpointPool()
    fd = FileDiscovery(f, pool)
    assert fd.poll() and len(pool) == 1
    assert not fd.poll()  # unchanged content: no reload
    f.write_text("- {address: nonsense}\n")
    assert not fd.poll() and len(pool) == 1
    f.write_text("[unclosed\n")
    assert not fd.poll() and len(pool) == 1
    f.unlink()
    assert not fd.poll() and len(pool) == 1
    f.write_text("- 127.0.0.1:2\n- 127.0.0.1:3\n")
    assert fd.poll() and {e.address for e in pool.all()} == {"127.0.0.1:2", "127.0.0.1:3"}


def test_bad_entries_are_rejected():
    for bad in ("nope", {"address": "1.2.3.4"}, {"address": "1.2.3.4:80", "role": "x"}, 7):
        with pytest.raises(ValueError):
            parse_spec(bad)
    assert parse_spec("1.2.3.4:80") == EndpointSpec("1.2.3.4:80", "both")


def test_pool_is_the_union_of_sources():
    pool = EndpointPool()
    gone = []
    pool.on_remove(gone.append)
    pool.set_source("a", [EndpointSpec("1.1.1.1:1")])
    pool.set_source("b", [EndpointSpec("1.1.1.1:1"), EndpointSpec("2.2.2.2:2")])
    pool.set_source("a", [])
    assert {e.address for e in pool.all()} == {"1.1.1.1:1", "2.2.2.2:2"} and gone == []
    pool.set_source("b", [EndpointSpec("2.2.2.2:2")])
    assert gone == ["1.1.1.1:1"]


def _pod(ip="10.1.2.3", ready="True", phase="Running", labels=None, deleting=False) -> V1Pod:
    return V1Pod(
        metadata=V1ObjectMeta(name="w", uid="u1", labels=labels or {},
                              deletion_timestamp=datetime.now(timezone.utc) if deleting else None),
        status=V1PodStatus(pod_ip=ip, phase=phase,
                           conditions=[V1PodCondition(type="Ready", status=ready)]))


def test_only_ready_pods_with_an_ip_are_endpoints():
    assert pod_endpoint(_pod(labels={"kvyard.io/role": "prefill"}), 8000) == \
        EndpointSpec("10.1.2.3:8000", "prefill")
    assert pod_endpoint(_pod(), 9000) == EndpointSpec("10.1.2.3:9000", "both")
    assert pod_endpoint(_pod(ip="fd00::1"), 8000).address == "[fd00::1]:8000"
    assert pod_endpoint(_pod(ready="False"), 8000) is None
    assert pod_endpoint(_pod(ip=None), 8000) is None
    assert pod_endpoint(_pod(phase="Pending"), 8000) is None
    assert pod_endpoint(_pod(deleting=True), 8000) is None
    assert selector_string(" app=kvyard, tier=worker ") == "app=kvyard,tier=worker"
    with pytest.raises(ValueError):
        selector_string("app")
