"""charts/kvyard's NetworkPolicies, evaluated (conftest's evaluator), not eyeballed."""
from __future__ import annotations


# --- NetworkPolicies: evaluated, not eyeballed ----------------------------------------------

def test_network_policies_let_only_the_intended_traffic_through(ch):
    objs = ch.objects("everything")
    pols = ch.by_kind(objs, "NetworkPolicy")
    gw, epp = ch._pod("demo", "gateway"), ch._pod("demo", "epp")
    prefill, decode = ch._pod("demo", "worker", "prefill"), ch._pod("demo", "worker", "decode")
    other_gw, other_worker = ch._pod("other", "gateway"), ch._pod("other", "worker", "both")
    stranger = {"app": "curl"}
    redis = {"app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": ch.RELEASE,
             "app.kubernetes.io/component": "redis"}
    operator = {**redis, "app.kubernetes.io/component": "operator"}
    ok = lambda s, d, port, ns=ch.NAMESPACE: ch.ingress_allowed(pols, s, d, port, ns)  # noqa: E731
    # workers' API (and metrics) port: the gateway, the EPP, the service's own workers
    assert ok(gw, decode, 8000) and ok(epp, decode, 8000) and ok(decode, prefill, 8000)
    assert not ok(stranger, decode, 8000) and not ok(other_gw, decode, 8000)
    assert not ok(other_worker, prefill, 8000) and not ok(operator, decode, 8000)
    assert not ok(redis, decode, 8000)
    # KV peer port: only the service's workers
    assert ok(decode, prefill, 8001) and not ok(gw, prefill, 8001) and not ok(epp, prefill, 8001)
    assert not ok(other_worker, prefill, 8001)
    # any other port on a worker: nobody
    assert not ok(gw, decode, 22) and not ok(decode, prefill, 9999)
    # Prometheus (metricsFrom) scrapes 8000 and the EPP's 9090, from its own namespace only
    prom = {"app": "prometheus"}
    assert ok(prom, decode, 8000, "monitoring") and ok(prom, epp, 9090, "monitoring")
    assert not ok(prom, decode, 8000) and not ok(prom, decode, 8001, "monitoring")
    # the EPP's ext_proc port: the service's gateway (and eppFrom); never the workers
    assert ok(gw, epp, 9002) and not ok(other_gw, epp, 9002) and not ok(decode, epp, 9002)
    assert not ok(stranger, epp, 9002) and ok({"app": "istio"}, epp, 9002, "istio-system")
    # gateways: gatewayFrom only (here: the ingress namespace)
    assert ok(stranger, gw, 8080, "ingress") and not ok(stranger, gw, 8080)
    assert not ok(stranger, gw, 9901, "ingress")
    # Redis: kvyard workers only
    assert ok(decode, redis, 6379) and ok(other_worker, redis, 6379)
    assert not ok(gw, redis, 6379) and not ok(epp, redis, 6379) and not ok(stranger, redis, 6379)
    assert not ok(decode, redis, 6380)
    # ... and the operator's preflight (it opens a connection, never authenticates)
    assert ok(operator, redis, 6379) and not ok(operator, decode, 8000)
    # the operator takes no connections
    assert not ok(stranger, operator, 8080) and not ok(gw, operator, 8080)


def test_network_policies_open_gateways_to_everyone_by_default(ch):
    pols = ch.by_kind(ch.objects("cpu"), "NetworkPolicy")
    gw, worker = ch._pod("demo", "gateway"), ch._pod("demo", "worker", "both")
    assert ch.ingress_allowed(pols, {"app": "x"}, gw, 8080, "elsewhere")
    assert not ch.ingress_allowed(pols, {"app": "x"}, worker, 8000)
    assert not ch.ingress_allowed(pols, {"app": "prometheus"}, worker, 8000, "monitoring")


def test_a_gateway_of_your_own_reaches_the_epp_and_the_workers(ch):
    """poolGatewayFrom: the user's gateway calls the EPP (ext_proc) and then the picked worker;
    kvyard's own gateway keeps both paths, strangers and other pods of that namespace get none."""
    theirs = {"istio.io/gateway-name": "inference"}
    for preset, opened in (("pool-gateway", True), ("cpu", False)):
        pols = ch.by_kind(ch.objects(preset), "NetworkPolicy")
        ok = lambda s, d, port, ns=ch.NAMESPACE: ch.ingress_allowed(pols, s, d, port, ns)  # noqa: E731
        gw, epp = ch._pod("demo", "gateway"), ch._pod("demo", "epp")
        worker = ch._pod("demo", "worker", "both")
        assert ok(theirs, epp, 9002, "istio-system") is opened
        assert ok(theirs, worker, 8000, "istio-system") is opened
        # kvyard's own gateway, either way
        assert ok(gw, epp, 9002) and ok(gw, worker, 8000)
        # never more than that: other ports, other pods of that namespace, the same labels
        # elsewhere
        assert not ok(theirs, worker, 8001, "istio-system")
        assert not ok(theirs, epp, 9004, "istio-system")
        assert not ok({"app": "x"}, worker, 8000, "istio-system")
        assert not ok({"app": "x"}, epp, 9002, "istio-system")
        assert not ok(theirs, worker, 8000) and not ok(theirs, epp, 9002)


def test_operator_egress_is_dns_and_the_api_server_only(ch):
    pol = ch.one(ch.objects("default"), "NetworkPolicy", "kvyard-operator")
    assert set(pol["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert pol["spec"]["ingress"] == []
    rules = pol["spec"]["egress"]
    ports = sorted((p["protocol"], p["port"]) for r in rules for p in r["ports"])
    assert ports == [("TCP", 53), ("TCP", 443), ("TCP", 6443), ("UDP", 53)]
    [api] = [r for r in rules if "to" in r]
    assert all("ipBlock" in peer for peer in api["to"])
    # with a Redis: its port too, for the preflight's TCP connect (RedisUnreachable in status)
    rules = ch.one(ch.objects("cpu"), "NetworkPolicy", "kvyard-operator")["spec"]["egress"]
    [to_redis] = [r for r in rules if any(p["port"] == 6379 for p in r["ports"])]
    assert to_redis["to"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": ch.RELEASE,
        "app.kubernetes.io/component": "redis"}}}]
    rules = ch.one(ch.objects("external-redis"), "NetworkPolicy", "kvyard-operator")["spec"][
        "egress"]
    assert {"ports": [{"protocol": "TCP", "port": 6379}]} in rules


def test_network_policy_ports_match_the_operators_containers(ch):
    """The ports the policies open are the ones kvyard's components listen on."""
    from kvyard.common import wire

    pols = ch.by_kind(ch.objects("cpu"), "NetworkPolicy")
    opened = {p["port"] for pol in pols for r in pol["spec"]["ingress"] for p in r.get("ports", [])}
    assert {8000, wire.EPP_EXT_PROC_PORT, 8080, 6379} <= opened
    peer = getattr(wire, "WORKER_KV_PEER_PORT", None)
    if peer is not None:
        assert ch.chart().values["workers"]["kvPeerPort"] == peer
        assert peer in opened
    for name in ("WORKER_HTTP_PORT", "GATEWAY_HTTP_PORT"):
        if hasattr(wire, name):
            assert getattr(wire, name) in opened
