"""charts/kvyard: Helm's lint, each preset rendered and checked against the Kubernetes
schemas (no cluster: kube-apiserver's admission is what this stands in for), what the
presets install, and where the CRDs ship.
"""
from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
import yaml

import helm_python as helm

# The names of conftest's PRESETS (the chart's values for each), for parametrize.
PRESETS = ("default", "cpu", "gpu", "everything", "external-redis", "pool-gateway")


# --- Helm: lint and render -----------------------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
def test_lint_clean(ch, preset):
    report = helm.lint(str(ch.CHART), copy.deepcopy(ch.PRESETS[preset]), strict=True,
                       namespace=ch.NAMESPACE)
    assert report["errors"] == [], report
    # severity 1 is info ("icon is recommended"); warnings and errors fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("preset", list(PRESETS))
def test_renders_and_validates_against_kubernetes_schemas(ch, preset):
    objs = ch.objects(preset)
    assert objs
    custom = {"InferenceService", "PodMonitor"}
    for obj in objs:
        body = {k: v for k, v in obj.items() if not k.startswith("__")}
        if obj["kind"] in custom:
            continue
        for version in ch.K8S_VERSIONS:
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{obj['__template']} {obj['kind']}/{obj['metadata']['name']} "
                            f"(Kubernetes {version}): {e.message} at {list(e.path)}")
        assert obj["metadata"].get("namespace", ch.NAMESPACE) == ch.NAMESPACE or \
            obj["kind"] in ("ClusterRole", "ClusterRoleBinding") or \
            obj["kind"] == "RoleBinding"
    names = [(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objs]
    assert len(names) == len(set(names)), "two objects with one name"


def test_presets_install_what_they_say(ch):
    cpu, gpu, default = ch.objects("cpu"), ch.objects("gpu"), ch.objects("default")
    for objs in (cpu, gpu, default):
        ch.one(objs, "Deployment", "kvyard-operator")
        ch.one(objs, "ServiceAccount", "kvyard-operator")
        ch.one(objs, "ClusterRole", "kvyard-operator")
    assert not ch.by_kind(default, "InferenceService") and not ch.by_kind(default, "StatefulSet")
    [demo] = ch.by_kind(cpu, "InferenceService")
    assert demo["spec"]["model"]["source"] == "demo" and demo["spec"]["engine"]["device"] == "cpu"
    [llama] = ch.by_kind(gpu, "InferenceService")
    assert llama["spec"]["engine"]["device"] == "cuda"
    res = llama["spec"]["engine"]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
    assert "prefill" in llama["spec"]["pools"] and "decode" in llama["spec"]["pools"]
    for objs in (cpu, gpu):
        ch.one(objs, "Deployment", "kvyard-redis")
    # GPU preset: the operator and Redis keep off GPU nodes
    for name in ("kvyard-operator", "kvyard-redis"):
        pod = ch.one(gpu, "Deployment", name)["spec"]["template"]["spec"]
        assert "nvidia.com/gpu.present" in json.dumps(pod["affinity"])
        assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod["tolerations"]


def test_crds_ship_in_crds_dir_not_templates(ch):
    """Helm installs crds/ before the templates (so the first InferenceService can be created)
    and never deletes or upgrades them; a CRD under templates/ would be."""
    for preset in ch.PRESETS:
        assert not ch.by_kind(ch.objects(preset), "CustomResourceDefinition")
    if not ch.crd_files():
        pytest.skip("charts/kvyard/crds/ is still empty (the operator's CRD is not written yet)")
    loaded = ch.chart().crds
    assert any("inferenceservices.kvyard.io" in c.get("name", "") for c in loaded), loaded
    for path in ch.crd_files():
        crd = yaml.safe_load(path.read_text())
        kubernetes_validate.validate(crd, ch.K8S_VERSIONS[-1], strict=True)


def test_parametrized_preset_names_are_conftests(ch):
    # test_chart_values.py spells the same tuple: a preset added to conftest alone would
    # silently escape the parametrized tests.
    assert set(PRESETS) == set(ch.PRESETS)
