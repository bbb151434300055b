"""The chart's NetworkPolicies let a service's EPP (and nobody else) reach its workers'
KV-event ports, the ports the operator renders into the workers' flags and annotations."""
from __future__ import annotations


def test_only_the_services_epp_reaches_the_workers_kv_event_ports(ch):
    from kvyard.common import wire

    pols = ch.by_kind(ch.objects("everything"), "NetworkPolicy")
    gw, epp = ch._pod("demo", "gateway"), ch._pod("demo", "epp")
    decode, prefill = ch._pod("demo", "worker", "decode"), ch._pod("demo", "worker", "prefill")
    other_epp = ch._pod("other", "epp")
    ok = lambda s, d, port: ch.ingress_allowed(pols, s, d, port, ch.NAMESPACE)  # noqa: E731
    for port in (wire.WORKER_KV_EVENTS_PORT, wire.WORKER_KV_REPLAY_PORT):
        assert ok(epp, decode, port) and ok(epp, prefill, port)
        assert not ok(gw, decode, port) and not ok(prefill, decode, port)
        assert not ok(other_epp, decode, port) and not ok({"app": "curl"}, decode, port)
    assert not ok(epp, decode, wire.WORKER_KV_REPLAY_PORT + 1)
