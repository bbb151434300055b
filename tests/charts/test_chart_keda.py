"""charts/kvyard and KEDA: the EPPs' scaler port is open to KEDA's operator pods only, the
operator may manage ScaledObjects with exactly the verbs it calls, the keda values are
checked, and an autoscaled first InferenceService renders its ScaledObjects aimed at a port
the policy opens."""
from __future__ import annotations

import copy

import pytest
import yaml

import helm_python as helm

from kvyard.common import wire
from kvyard.operator import render, spec as op_spec

KEDA_OP = {"app.kubernetes.io/name": "keda-operator", "app": "keda-operator"}


def test_scaler_port_admits_only_kedas_operator(ch):
    port = wire.EPP_SCALER_PORT
    for preset, keda_ns in (("cpu", "keda"), ("everything", "autoscaling")):
        pols = ch.by_kind(ch.objects(preset), "NetworkPolicy")
        epp, gw = ch._pod("demo", "epp"), ch._pod("demo", "gateway")
        worker = ch._pod("demo", "worker", "both")
        ok = lambda s, d, p, ns=ch.NAMESPACE: ch.ingress_allowed(pols, s, d, p, ns)  # noqa: E731
        assert ok(KEDA_OP, epp, port, keda_ns)
        # not KEDA's other pods, not another namespace, not kvyard's own pods
        assert not ok({"app.kubernetes.io/name": "keda-operator-metrics-apiserver"}, epp, port,
                      keda_ns)
        assert not ok(KEDA_OP, epp, port, "default" if keda_ns == "keda" else "keda")
        assert not ok(gw, epp, port) and not ok(worker, epp, port)
        # and KEDA reaches nothing else of the EPP's, nor the workers
        assert not ok(KEDA_OP, epp, wire.EPP_EXT_PROC_PORT, keda_ns)
        assert not ok(KEDA_OP, epp, wire.EPP_METRICS_PORT, keda_ns)
        assert not ok(KEDA_OP, worker, 8000, keda_ns)


def test_operator_may_manage_scaled_objects_with_exactly_its_verbs(ch):
    for preset in ("default", "everything"):
        rules = ch.one(ch.objects(preset), "ClusterRole", "kvyard-operator")["rules"]
        keda = [r for r in rules if "keda.sh" in r["apiGroups"]]
        assert keda == [{"apiGroups": ["keda.sh"], "resources": ["scaledobjects"],
                         "verbs": ["list", "create", "patch", "delete"]}]


@pytest.mark.parametrize("bad", [
    {"keda": {"namespace": "Not_A_Namespace"}},
    {"keda": {"operatorLabels": None}},
    {"keda": {"operatorLabels": {"app": 1}}},
    {"keda": {"namespaces": "keda"}},
], ids=["namespace", "labels removed", "label not a string", "unknown key"])
def test_keda_values_are_checked(ch, bad):
    with pytest.raises(helm.HelmValuesError):
        ch.chart().validate_schema(copy.deepcopy(bad))


def test_autoscaled_first_service_points_keda_at_an_open_port(ch):
    values = copy.deepcopy(ch.PRESETS["cpu"])
    values["inferenceService"]["spec"] = {
        **values["inferenceService"].get("spec", {}),
        "scaleToZero": {"enabled": True, "idleSeconds": 60},
        "pools": {"both": {"minReplicas": 0, "maxReplicas": 2}}}
    out = ch.chart().render(values, name=ch.RELEASE, namespace=ch.NAMESPACE, is_install=True)
    docs = [d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    [isvc] = [d for d in docs if d["kind"] == "InferenceService"]
    ch.validate_inference_service(isvc)

    body = {**isvc, "metadata": {**isvc["metadata"], "uid": "u-1", "generation": 1}}
    children = render.render_all(op_spec.parse(body))
    [so] = [o for o in children if o["kind"] == "ScaledObject"]
    name = isvc["metadata"]["name"]
    assert so["spec"]["triggers"][0]["metadata"]["scalerAddress"] == \
        f"{name}-epp.{ch.NAMESPACE}.svc.cluster.local:9004"
    pols = [d for d in docs if d["kind"] == "NetworkPolicy"]
    epp = ch._pod(name, "epp")
    assert ch.ingress_allowed(pols, KEDA_OP, epp, 9004, "keda")
