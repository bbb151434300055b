"""charts/kvyard: what values.schema.json accepts and refuses, and what the CRD accepts (the
chart's first InferenceService, the examples) and refuses.
"""
from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

import helm_python as helm

# The names of conftest's PRESETS (the chart's values for each), for parametrize.
PRESETS = ("default", "cpu", "gpu", "everything", "external-redis", "pool-gateway")

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvyard"
EXAMPLES = CHART / "examples"


# --- values.schema.json --------------------------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
def test_schema_accepts_presets(ch, preset):
    ch.chart().validate_schema(copy.deepcopy(ch.PRESETS[preset]))


BAD_VALUES = {
    "unbounded redis policy": {"redis": {"maxMemoryPolicy": "noeviction"}},
    "volatile policy": {"redis": {"maxMemoryPolicy": "volatile-lru"}},
    "no redis cap": {"redis": {"maxMemoryBytes": 0}},
    "cap as a string": {"redis": {"maxMemoryBytes": "1gb"}},
    "two operators without peering": {"operator": {"replicas": 2}},
    "unknown top-level key": {"oprator": {"replicas": 1}},
    "unknown operator key": {"operator": {"replica": 1}},
    "bad pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "empty image repository": {"image": {"repository": ""}},
    "kv peer port on the API port": {"workers": {"kvPeerPort": 8000}},
    "port out of range": {"workers": {"kvPeerPort": 70000}},
    "service name not DNS-1123": {"inferenceService": {"name": "My_Service"}},
    "password in the external URL": {"redis": {"enabled": False, "external": {
        "url": "redis://:hunter2@cache:6379", "secretName": "s"}}},
    "external URL without a Secret": {"redis": {"enabled": False, "external": {
        "url": "redis://cache:6379"}}},
    "external URL and the chart's Redis": {"redis": {"enabled": True, "external": {
        "url": "redis://cache:6379", "secretName": "s"}}},
    "api server CIDR not a CIDR": {"networkPolicy": {"apiServer": {"cidrs": ["kubernetes"]}}},
    "pdb maxUnavailable 0": {"podDisruptionBudget": {"maxUnavailable": 0}},
    "cleanup timeout as text": {"cleanupHook": {"timeoutSeconds": "2m"}},
    "inference service spec not an object": {"inferenceService": {"spec": "demo"}},
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_schema_rejects_bad_values(ch, case):
    with pytest.raises(helm.HelmValuesError):
        ch.chart().validate_schema(copy.deepcopy(BAD_VALUES[case]))
    # ... and so does rendering, which is what `helm install` runs
    with pytest.raises(helm.HelmError):
        ch.chart().render(copy.deepcopy(BAD_VALUES[case]), name=ch.RELEASE, namespace=ch.NAMESPACE)


# --- the CRD: the first InferenceService and the examples ------------------------------------


@pytest.mark.parametrize("preset", ["cpu", "gpu", "external-redis"])
def test_first_inference_service_validates_against_crd(ch, preset):
    ch._needs_crd()
    [obj] = ch.by_kind(ch.objects(preset), "InferenceService")
    ch.validate_inference_service(obj)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_crd(ch, path):
    ch._needs_crd()
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        ch.validate_inference_service(doc)


def test_crd_schema_rejects_bad_examples(ch):
    """The strict validation above is not vacuous."""
    ch._needs_crd()
    good = yaml.safe_load((ch.EXAMPLES / "demo-cpu.yaml").read_text())
    for mutate in (lambda s: s["engine"].update(name="tgi"),
                   lambda s: s["pools"]["both"].update(replicas=-1),
                   lambda s: s["model"].update(sourc="demo")):
        bad = copy.deepcopy(good)
        mutate(bad["spec"])
        with pytest.raises((jsonschema.ValidationError, ValueError)):
            ch.validate_inference_service(bad)
