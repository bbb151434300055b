"""The CRD: generated file up to date, a valid CRD with a structural schema whose CEL
rules compile, examples accepted, bad specs refused by the schema *and* by the
operator's own parse (for objects the schema did not check)."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvyard.common import wire
from kvyard.operator import crd
from kvyard.operator.schema_check import compile_rules, validate
from kvyard.operator.spec import SpecError, parse

EXAMPLES = sorted((Path(crd.__file__).parent / "examples").glob("*.yaml"))


def test_crd_file_is_generated_from_the_schema() -> None:
    assert crd.CRD_FILE.read_text() == crd.crd_yaml(), \
        "stale CRD: run python -m kvyard.operator.crd --write"


def test_crd_is_a_valid_crd_with_the_contract_names() -> None:
    doc = yaml.safe_load(crd.CRD_FILE.read_text())
    kubernetes_validate.validate(doc, "1.33", strict=True)
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "inferenceservices.kvyard.io" == wire.CRD_NAME
    assert (spec["group"], spec["scope"]) == ("kvyard.io", "Namespaced")
    assert spec["names"]["kind"] == "InferenceService"
    assert spec["names"]["shortNames"] == ["kis"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == \
        ["Ready", "Reason", "Engine", "Device", "Gateway", "Age"]


def _structural(node: dict, path: str) -> list[str]:
    """Kubernetes' structural-schema rule: every node says its type (or is int-or-string
    or preserves unknown fields)."""
    bad = []
    if not (node.get("type") or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")):
        bad.append(path)
    for name, sub in (node.get("properties") or {}).items():
        bad += _structural(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            bad += _structural(node[key], f"{path}.{key}")
    return bad


def test_schema_is_structural_and_its_rules_compile() -> None:
    schema = yaml.safe_load(crd.CRD_FILE.read_text())["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]
    assert _structural(schema, "") == []
    assert len(compile_rules(schema)) >= 10


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_and_parse(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert validate(obj) == []
    parse({**obj, "metadata": {**obj["metadata"], "namespace": "default", "uid": "u"}})


def _cr(spec: dict) -> dict:
    return {"apiVersion": "kvyard.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "x", "namespace": "default", "uid": "u"}, "spec": spec}


BAD = [
    ({"engine": {"name": "tgi"}}, "engine.name", "unknown engine"),
    ({"pools": {"both": {"minReplicas": -1}}}, "minimum of 0", "outside"),
    ({"pools": {"decode": {"replicas": -2}}}, "minimum of 0", "outside"),
    ({"pools": {"both": {"minReplicas": 3, "maxReplicas": 2}}}, "minReplicas must be <=",
     "minReplicas 3 > maxReplicas 2"),
    ({"pools": {"both": {"minReplicas": 1, "maxReplicas": 2, "replicas": 5}}},
     "within [minReplicas", "outside [1, 2]"),
    ({"pools": {"both": {"minReplicas": 0}}}, "needs scaleToZero", "needs scaleToZero"),
    ({"pools": {"prefill": {}}}, "decode or both pool", "decode or both pool"),
    ({"engine": {"name": "vllm"}}, "cannot serve the demo model", "cannot serve the demo"),
    ({"model": {"source": "gguf", "path": "/m/x.bin"}}, "ending in .gguf", ".gguf path"),
    ({"model": {"source": "pvc"}}, "needs pvc.claimName", "needs pvc.claimName"),
    ({"engine": {"device": "tpu"}}, "engine.device", "engine.device"),
    ({"kvstore": {"redis": {"url": "http://x"}}}, "does not match", "want redis://"),
]


@pytest.mark.parametrize("spec, schema_says, operator_says", BAD,
                         ids=[str(b[0]) for b in BAD])
def test_bad_specs_are_refused_by_schema_and_operator(spec: dict, schema_says: str,
                                                      operator_says: str) -> None:
    errors = validate(_cr(spec))
    assert any(schema_says in e for e in errors), errors
    with pytest.raises(SpecError, match=operator_says.replace("[", r"\[")):
        parse(_cr(spec))


def test_defaults_fill_an_empty_spec() -> None:
    s = parse(_cr({}))
    assert (s.model.source, s.engine.name, s.engine.device, s.engine.block_size) == \
        ("demo", "kvyard", "cpu", 16)
    assert [(p.role, p.min_replicas, p.max_replicas, p.replicas) for p in s.pools] == \
        [("both", 1, 1, 1)]
    assert (s.routing.prefix_cache, s.routing.non_cached_tokens) == (3.0, 256)
    assert not s.scale_to_zero and not s.inference_pool and s.kvstore is None
