"""Several base models and LoRA adapters in one InferenceService: the workers' vLLM LoRA
flags and adapter volumes, one pool and one InferencePool per base model whose selectors
never overlap, the EPP's models file and lora-affinity, status per pool; against kmock."""
from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from kvyard.common import wire
from kvyard.epp.models import ModelRoutes
from kvyard.operator.render import render_all
from kvyard.operator.schema_check import validate
from kvyard.operator.spec import SpecError, parse
from kvyard.cli import build_parser

from .conftest import CRS

SPEC = {"model": {"source": "demo"}, "inferencePool": {"enabled": True},
        "engine": {"maxLoras": 2},
        "models": [{"name": "beta", "model": {"source": "demo"}, "replicas": 2}],
        "adapters": [
            {"name": "sql", "rank": 24, "source": {"pvc": {"claimName": "adapters"},
                                                   "path": "sql-lora"}},
            {"name": "chat", "source": {"image": {"reference": "reg/chat-lora:1"}}},
            {"name": "beta-tone", "model": "beta", "rank": 8,
             "source": {"path": "/models/tone"}}]}
CR = {"metadata": {"name": "demo", "namespace": "team-a", "uid": "u-1", "generation": 1},
      "spec": SPEC}


def _by(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in children}


def _args(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_two_models_and_adapters_render() -> None:
    out = _by(render_all(parse(copy.deepcopy(CR))))
    primary, beta = out[("Deployment", "demo-both")], out[("Deployment", "demo-beta-both")]
    a = _args(primary)
    assert a[a.index("--lora-modules") + 1:a.index("--max-loras")] == [
        "sql=/adapters/sql/sql-lora", "chat=/adapters/chat"]
    assert a[a.index("--max-loras") + 1] == "2" and a[a.index("--max-lora-rank") + 1] == "32"
    assert "--enable-lora" in a
    b = _args(beta)
    assert b[b.index("--served-model-name") + 1] == "beta"
    assert b[b.index("--lora-modules") + 1] == "beta-tone=/models/tone"
    assert b[b.index("--max-lora-rank") + 1] == "8" and beta["spec"]["replicas"] == 2
    auto = copy.deepcopy(CR)
    auto["spec"]["autoscaling"] = {"enabled": True}
    deps = _by(render_all(parse(auto)))
    assert deps[("Deployment", "demo-beta-both")]["spec"]["replicas"] == 2
    assert "replicas" not in deps[("Deployment", "demo-both")]["spec"]
    vols = {v["name"]: v for v in primary["spec"]["template"]["spec"]["volumes"]}
    assert vols["adapter-sql"]["persistentVolumeClaim"] == {"claimName": "adapters",
                                                            "readOnly": True}
    assert vols["adapter-chat"]["image"]["reference"] == "reg/chat-lora:1"
    # no pool's Deployment selects another's pods; each InferencePool selects its own
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for (k, n), d in out.items()
            if k == "Deployment" and d["metadata"]["labels"][wire.COMPONENT_LABEL] == "worker"}
    for (k, n), d in out.items():
        if k == "Deployment" and n in pods:
            assert [p for p, lab in pods.items()
                    if _matches(d["spec"]["selector"]["matchLabels"], lab)] == [n]
    assert pods["demo-both"][wire.POOL_LABEL] == "default"
    assert pods["demo-beta-both"][wire.POOL_LABEL] == "beta"
    ips = {n: o["spec"]["selector"]["matchLabels"] for (k, n), o in out.items()
           if k == "InferencePool"}
    assert {n: [p for p, lab in pods.items() if _matches(sel, lab)] for n, sel in ips.items()} \
        == {"demo-default": ["demo-both"], "demo-beta": ["demo-beta-both"]}
    # the workers' flags parse with `kvyard worker`'s own parser: all of them once the worker
    # takes vLLM's LoRA flags, the rest before
    lora = a.index("--enable-lora"), a.index("--max-lora-rank") + 2
    rest = a[:lora[0]] + a[lora[1]:]
    assert build_parser(rest).parse_args(rest).model == "demo"
    if "--enable-lora" in build_parser(["worker", "-h"])._subparsers._group_actions[0] \
            .choices["worker"].format_help():
        assert build_parser(a).parse_args(a).max_loras == 2


def test_epp_gets_the_models_file_and_lora_affinity() -> None:
    out = _by(render_all(parse(copy.deepcopy(CR))))
    cm = out[("ConfigMap", "demo-epp")]["data"]
    routes = ModelRoutes.parse(yaml.safe_load(cm["models.yaml"]))
    assert {n: (r.pool, r.parent) for n, r in routes.routes.items()} == {
        "SmolLM2-135M-Instruct": ("default", None), "sql": ("default", "SmolLM2-135M-Instruct"),
        "chat": ("default", "SmolLM2-135M-Instruct"), "beta": ("beta", None),
        "beta-tone": ("beta", "beta")}
    sched = yaml.safe_load(cm["scheduler.yaml"])
    assert {"type": "lora-affinity", "weight": 4.0} in \
        sched["profiles"]["default"]["scorers"]
    epp = _args(out[("Deployment", "demo-epp")])
    assert epp[epp.index("--models-file") + 1] == "/etc/kvyard/epp/models.yaml"


def test_bad_model_and_adapter_specs() -> None:
    def bad(patch: dict, why: str) -> None:
        cr = copy.deepcopy(CR)
        cr["spec"].update(patch)
        with pytest.raises(SpecError, match=why):
            parse(cr)
    bad({"adapters": [{"name": "x", "model": "gamma", "source": {"path": "/a"}}]}, "not served")
    bad({"adapters": [{"name": "beta", "source": {"path": "/a"}}]}, "names two")
    bad({"adapters": [{"name": "x", "source": {}}]}, "source")
    bad({"model": {"source": "hf", "path": "/m"}}, "servedModelName")
    bad({"models": [{"name": "default"}]}, "default")
    problems = validate({"spec": dict(SPEC, adapters=[{"name": "x", "source": {}}])})
    assert any("needs a path" in p for p in problems), problems
    assert validate({"spec": copy.deepcopy(SPEC)}) == []


async def test_operator_reports_adapters_per_pool(kube, operator, wait_for) -> None:
    async with operator():
        await kube.create("demo", copy.deepcopy(SPEC))
        await wait_for(lambda: ("Deployment", "demo-beta-both") in kube.children(),
                       what="beta's pool")
        await kube.api.settle()
        await wait_for(lambda: (kube.cr().get("status") or {}).get("models"), what="models")
        st = kube.cr()["status"]
        assert st["models"] == [
            {"name": "SmolLM2-135M-Instruct", "pool": "default", "adapters": ["sql", "chat"]},
            {"name": "beta", "pool": "beta", "adapters": ["beta-tone"]}]
        await wait_for(lambda: set(kube.cr()["status"]["pools"]) == {"both", "beta-both"})
        assert ("InferencePool", "demo-beta") in kube.children()
        await kube.patch(f"{CRS}/demo", {"spec": {"models": None, "adapters": None}})
        await wait_for(lambda: ("Deployment", "demo-beta-both") not in kube.children(),
                       what="beta's pool pruned")


def test_epp_keys_each_pool_with_its_own_models_tokenizer() -> None:
    """An extra model whose weights the EPP can read gets its tokenizer in the models file
    (its volume mounted in the EPP pod); one the EPP cannot read turns precise routing off
    for the whole service, so no pool is keyed with another model's tokenizer."""
    cr = copy.deepcopy(CR)
    cr["spec"]["models"] = [
        {"name": "beta", "model": {"source": "demo"}},
        {"name": "gamma", "model": {"source": "pvc", "pvc": {"claimName": "gamma-weights"},
                                    "path": "gamma-8b"}}]
    out = _by(render_all(parse(cr)))
    cm = out[("ConfigMap", "demo-epp")]["data"]
    rows = {r["name"]: r for r in yaml.safe_load(cm["models.yaml"])["models"]}
    assert rows["beta"]["tokenizer"] == "demo"
    assert rows["gamma"]["tokenizer"] == "/models-gamma/gamma-8b"
    routes = ModelRoutes.parse(yaml.safe_load(cm["models.yaml"]))
    assert routes.pool_tokenizers("demo") == {"gamma": "/models-gamma/gamma-8b"}
    pod = out[("Deployment", "demo-epp")]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model-gamma"]["persistentVolumeClaim"] == {"claimName": "gamma-weights",
                                                            "readOnly": True}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["model-gamma"] == {"name": "model-gamma", "mountPath": "/models-gamma",
                                     "readOnly": True}
    sched = yaml.safe_load(cm["scheduler.yaml"])
    types = [x["type"] for x in sched["profiles"]["default"]["scorers"]]
    assert "precise-prefix-cache" in types
    hf = copy.deepcopy(cr)
    hf["spec"]["models"][1]["model"] = {"source": "hf", "path": "org/gamma-8b"}
    out = _by(render_all(parse(hf)))
    cm = out[("ConfigMap", "demo-epp")]["data"]
    assert all("tokenizer" not in r for r in yaml.safe_load(cm["models.yaml"])["models"])
    types = [x["type"] for x in yaml.safe_load(cm["scheduler.yaml"])["profiles"]["default"]["scorers"]]
    assert "precise-prefix-cache" not in types
    kubernetes_validate.validate(_by(render_all(parse(cr)))[("Deployment", "demo-epp")], "1.33", strict=True)
