"""Where the EPP learns each endpoint's KV-event ports: the endpoints file, the pod
annotations, the --kv-events-port convention (epp/kvevents/sources.py)."""
from __future__ import annotations

import pytest
from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus

from kvyard.epp.kvevents.sources import stream_of
from kvyard.epp.pool.discovery_file import parse_endpoints_yaml
from kvyard.epp.pool.discovery_k8s import pod_endpoint
from kvyard.epp.pool.endpoints import Endpoint, EndpointPool


def test_endpoints_file_names_the_streams_and_ranks() -> None:
    specs = parse_endpoints_yaml("""
endpoints:
  - {address: "10.0.0.5:8000", kv_events: "tcp://10.0.0.5:5557",
     kv_events_replay: "tcp://10.0.0.5:5558", data_parallel_rank: 0}
  - {address: "10.0.0.5:8001", kv_events: "tcp://10.0.0.5:5557", data_parallel_rank: 1}
  - 10.0.0.6:8000
""")
    assert [(s.kv_events, s.kv_replay, s.dp_rank) for s in specs] == [
        ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", 0), ("tcp://10.0.0.5:5557", None, 1),
        (None, None, None)]
    for bad in ('[{address: "1.2.3.4:1", kv_events: "http://x"}]',
                '[{address: "1.2.3.4:1", data_parallel_rank: -1}]'):
        with pytest.raises(ValueError):
            parse_endpoints_yaml(bad)
    pool = EndpointPool()
    pool.set_source("file", specs)
    gen = pool.generation
    pool.set_source("file", specs)
    assert pool.generation == gen               # nothing changed
    pool.set_source("file", specs[1:])
    assert pool.get("10.0.0.5:8001").dp_rank == 1 and pool.generation == gen + 1


def test_pod_annotations_and_the_port_convention() -> None:
    def pod(ann):
        return V1Pod(metadata=V1ObjectMeta(name="w", annotations=ann),
                     status=V1PodStatus(pod_ip="10.1.2.3", phase="Running",
                                        conditions=[V1PodCondition(type="Ready",
                                                                   status="True")]))
    spec = pod_endpoint(pod({"kvyard.io/kv-events-port": "5557",
                             "kvyard.io/kv-events-replay-port": "5558"}), 8000)
    assert (spec.kv_events, spec.kv_replay) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    assert pod_endpoint(pod(None), 8000).kv_events is None
    ep = Endpoint("10.1.2.3:8000")
    assert stream_of(ep, None) is None
    assert stream_of(ep, 5557) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    ep.kv_events = "tcp://10.9.9.9:1"
    assert stream_of(ep, 5557) == ("tcp://10.9.9.9:1", None)   # its own wins
