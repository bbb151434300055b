"""The chart with inferenceService.spec.epp.replicas: 2: the EPP's PodDisruptionBudget keeps
one up (minAvailable 1), the CR validates against the CRD, and the NetworkPolicy lets the
replicas share picks and the gateways health-check them."""
from __future__ import annotations

import copy

import yaml

from . import conftest as ch


def _objects(values: dict) -> list[dict]:
    out = ch.chart().render(values, name=ch.RELEASE, namespace=ch.NAMESPACE, is_install=True)
    return [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]


def test_epp_replicas_two_gets_min_available_one_and_open_replica_ports() -> None:
    values = copy.deepcopy(ch.PRESETS["cpu"])
    values["inferenceService"]["spec"]["epp"] = {"replicas": 2}
    values.setdefault("networkPolicy", {})["enabled"] = True
    objs = _objects(values)
    pdb = ch.one(objs, "PodDisruptionBudget", "demo-epp")
    assert pdb["spec"] == {**pdb["spec"], "minAvailable": 1} and "maxUnavailable" not in pdb["spec"]
    assert "maxUnavailable" in ch.one(objs, "PodDisruptionBudget", "demo-worker")["spec"]
    [isvc] = ch.by_kind(objs, "InferenceService")
    assert isvc["spec"]["epp"] == {"replicas": 2}
    ch.validate_inference_service(isvc)
    pols = ch.by_kind(objs, "NetworkPolicy")
    gw, epp = ch._pod("demo", "gateway"), ch._pod("demo", "epp")
    for port in (9005, 9006):
        assert ch.ingress_allowed(pols, epp, epp, port, ch.NAMESPACE)
        assert not ch.ingress_allowed(pols, {"app": "curl"}, epp, port, ch.NAMESPACE)
    assert ch.ingress_allowed(pols, gw, epp, 9003, ch.NAMESPACE)


def test_one_epp_keeps_max_unavailable() -> None:
    pdb = ch.one(_objects(copy.deepcopy(ch.PRESETS["cpu"])), "PodDisruptionBudget", "demo-epp")
    assert "minAvailable" not in pdb["spec"] and pdb["spec"]["maxUnavailable"] == 1
