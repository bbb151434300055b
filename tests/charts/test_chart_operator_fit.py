"""charts/kvyard against what the operator actually renders for its InferenceServices: the
policies, PDBs and monitors fit the children, their kvyard commands parse, NOTES names
the gateway.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvyard"
EXAMPLES = CHART / "examples"


# --- the chart against what the operator actually renders ----------------------------------

@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_chart_policies_pdbs_and_monitors_fit_the_operators_children(ch, preset):
    objs = ch.objects(preset)
    children = ch._children(preset)
    pods = ch._pods(children)
    pols = ch.by_kind(objs, "NetworkPolicy")
    comp = lambda labels: labels["kvyard.io/component"]  # noqa: E731
    workers = [p for p in pods if comp(p[1]) == "worker"]
    [epp] = [p for p in pods if comp(p[1]) == "epp"]
    [gw] = [p for p in pods if comp(p[1]) == "gateway"]
    assert workers
    for _, labels, _ in pods:  # every child pod is isolated by some policy
        assert [p for p in pols if ch._selects(p["spec"]["podSelector"], labels)], labels
    allowed = lambda src, dst, port: ch.ingress_allowed(pols, src[1], dst[1], port)  # noqa: E731
    for w in workers:
        http = w[2]["http"]
        assert allowed(gw, w, http) and allowed(epp, w, http)
        assert not allowed(({}, {"app": "x"}, {}), w, http)
        for other in workers:
            assert allowed(other, w, http)  # the P/D prefill leg
            if "kv-peer" in w[2]:
                assert allowed(other, w, w[2]["kv-peer"])
                assert not allowed(gw, w, w[2]["kv-peer"])
        if "kv-peer" in w[2]:
            assert w[2]["kv-peer"] == ch.chart().values["workers"]["kvPeerPort"]
    assert allowed(gw, epp, epp[2]["ext-proc"]) and not allowed(workers[0], epp, epp[2]["ext-proc"])
    assert allowed(({}, {"app": "client"}, {}), gw, gw[2]["http"])
    # the workers reach the chart's Redis, named by the URL the chart put in the spec
    redis_pod = {"app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": ch.RELEASE,
                 "app.kubernetes.io/component": "redis"}
    for w in workers:
        assert ch.ingress_allowed(pols, w[1], redis_pod, 6379)
        env = {e["name"]: e for d in ch.by_kind(children, "Deployment")
               if d["metadata"]["name"] == w[0]
               for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env["KVYARD_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert "password" in ch.one(objs, "Secret", ref["name"])["data"] and \
            ref["key"] == "password"
    svc = ch.one(objs, "Service", "kvyard-redis")
    [isvc] = ch.by_kind(objs, "InferenceService")
    assert isvc["spec"]["kvstore"]["redis"]["url"] == \
        f"redis://{svc['metadata']['name']}.{ch.NAMESPACE}.svc:{svc['spec']['ports'][0]['port']}"
    assert ch._selects({"matchLabels": svc["spec"]["selector"]}, redis_pod)
    # each child pod is under exactly one PDB of its component
    pdbs = ch.by_kind(objs, "PodDisruptionBudget")
    for name, labels, _ in pods:
        assert len([p for p in pdbs if ch._selects(p["spec"]["selector"], labels)]) == 1, name
    # PodMonitors: selectors and ports are the children's
    mons = ch.by_kind(ch.objects("everything"), "PodMonitor")
    for name, labels, ports in pods:
        for m in mons:
            if ch._selects(m["spec"]["selector"], labels):
                assert m["spec"]["podMetricsEndpoints"][0]["targetPort"] in ports.values(), name


def _example_children(ch, path: Path) -> list[dict]:
    from kvyard.operator import render, spec as op_spec

    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            doc["metadata"] = {**doc["metadata"], "namespace": ch.NAMESPACE, "uid": "u-1"}
            out += render.render_all(op_spec.parse(doc))
    return out


@pytest.mark.parametrize("source", ["cpu", "gpu", *sorted(p.name for p in EXAMPLES.glob("*.yaml"))])
def test_presets_and_examples_become_commands_kvyard_accepts(ch, source):
    """Each kvyard container the operator renders for the presets' InferenceServices and the
    examples, through the real `kvyard` parser: a value a preset sets that a worker or the EPP
    would refuse (a size it cannot read, a flag it lacks) fails here, not in a pod."""
    from kvyard.cli import build_parser

    children = ch._children(source) if source in ch.PRESETS else \
        _example_children(ch, ch.EXAMPLES / source)
    parsed = 0
    for d in ch.by_kind(children, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c.get("command") != ["kvyard"]:
                continue  # Envoy, stock vLLM
            args = c["args"]
            try:
                build_parser(args).parse_args(args)
            except SystemExit:
                pytest.fail(f"{d['metadata']['name']}: kvyard refuses {args}")
            parsed += 1
    assert parsed >= 1 + (source != "vllm-gpu.yaml")  # the EPP, and kvyard workers


def test_notes_name_the_gateway_the_operator_creates(ch):
    try:
        from kvyard.operator import render, spec as op_spec
    except ImportError:
        pytest.skip("kvyard.operator is not importable")
    notes = dict(ch._render("cpu"))["kvyard/templates/NOTES.txt"]
    [isvc] = ch.by_kind(ch.objects("cpu"), "InferenceService")
    body = {**{k: v for k, v in isvc.items() if not k.startswith("__")},
            "metadata": {**isvc["metadata"], "uid": "u-1"}}
    address = render.gateway_address(op_spec.parse(body))
    assert address in notes, (address, notes)
    gateway_svc = [o for o in ch._children("cpu") if o["kind"] == "Service"
                   and o["metadata"]["labels"]["kvyard.io/component"] == "gateway"]
    [svc] = gateway_svc
    assert f"port-forward svc/{svc['metadata']['name']} 8080:{svc['spec']['ports'][0]['port']}" \
        in notes
