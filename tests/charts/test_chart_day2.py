"""From chart values to the pods the operator creates: the operator's environment, parsed by
`kvyard operator`'s own parser, becomes its Defaults, and the children it renders agree
with the chart's NetworkPolicies and PDBs (image tags and digests, pull secrets, the KV peer
port, GPU placement)."""
from __future__ import annotations

import copy

import yaml

SHA = "sha256:" + "ab" * 32


def _objects(ch, values: dict) -> list[dict]:
    out = ch.chart().render(copy.deepcopy(values), name=ch.RELEASE, namespace=ch.NAMESPACE,
                            is_install=True)
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _defaults(ch, objs, monkeypatch):
    """The Defaults the chart's operator would run with."""
    from kvyard.cli import build_parser
    from kvyard.operator.spec import Defaults

    [c] = ch.one(objs, "Deployment", "kvyard-operator")["spec"]["template"]["spec"]["containers"]
    for e in c["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    a = build_parser(c["args"]).parse_args(c["args"])
    return Defaults(a.image, a.image_pull_policy, cuda_image=a.cuda_image,
                    image_pull_secrets=a.image_pull_secret,
                    service_account=a.pod_service_account, kv_peer_port=a.kv_peer_port,
                    cluster_domain=a.cluster_domain)


def _children(ch, objs, defaults) -> list[dict]:
    from kvyard.operator import render, spec as op_spec

    [isvc] = ch.by_kind(objs, "InferenceService")
    body = {**isvc, "metadata": {**isvc["metadata"], "uid": "u-1", "generation": 1}}
    return render.render_all(op_spec.parse(body, defaults))


def _pod(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def test_every_image_follows_one_tag_or_digest(ch, monkeypatch):
    d = _defaults(ch, ch.objects("gpu"), monkeypatch)
    assert (d.image, d.cuda_image) == ("ghcr.io/kvyard/kvyard:0.1.0",
                                       "ghcr.io/kvyard/kvyard:0.1.0-cuda")
    values = {**copy.deepcopy(ch.PRESETS["gpu"]),
              "image": {"repository": "reg.example/kvyard", "tag": "1.2.3", "digest": SHA,
                        "cudaDigest": SHA.replace("ab", "cd")},
              "imagePullSecrets": [{"name": "regcred"}],
              "workers": {"serviceAccountName": "models-reader"}}
    objs = _objects(ch, values)
    d = _defaults(ch, objs, monkeypatch)
    assert d.image == f"reg.example/kvyard:1.2.3@{SHA}"
    assert d.cuda_image == f"reg.example/kvyard:1.2.3-cuda@{SHA.replace('ab', 'cd')}"
    assert d.image_pull_secrets == ["regcred"]
    op = ch.one(objs, "Deployment", "kvyard-operator")
    assert _pod(op)["containers"][0]["image"] == d.image
    deps = {o["metadata"]["name"]: o for o in _children(ch, objs, d) if o["kind"] == "Deployment"}
    images = {n: _pod(dep)["containers"][0]["image"] for n, dep in deps.items()}
    assert images == {"llama3-8b-prefill": d.cuda_image, "llama3-8b-decode": d.cuda_image,
                      "llama3-8b-epp": d.image, "llama3-8b-gateway": d.image}
    for name, dep in deps.items():
        assert _pod(dep)["imagePullSecrets"] == [{"name": "regcred"}], name
        want = "llama3-8b-epp" if name.endswith("-epp") else "models-reader"
        assert _pod(dep)["serviceAccountName"] == want, name


def test_the_gpu_preset_tolerates_tainted_gpu_nodes(ch, monkeypatch):
    objs = ch.objects("gpu")
    [isvc] = ch.by_kind(objs, "InferenceService")
    assert "image" not in isvc["spec"]["engine"]  # the CUDA image follows image.tag
    deps = {o["metadata"]["name"]: o for o in _children(ch, objs, _defaults(ch, objs, monkeypatch))
            if o["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        dep = deps[f"llama3-8b-{role}"]
        p = _pod(dep)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            p["tolerations"]
        assert any(v["name"] == "shm" for v in p["volumes"])
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_a_changed_kv_peer_port_is_the_one_workers_use_and_policies_open(ch, monkeypatch):
    values = {**copy.deepcopy(ch.PRESETS["cpu"]), "workers": {"kvPeerPort": 9123}}
    values["inferenceService"]["spec"]["pools"] = {"prefill": {}, "decode": {}}
    objs = _objects(ch, values)
    kids = _children(ch, objs, _defaults(ch, objs, monkeypatch))
    [pre] = [o for o in kids if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-prefill"]
    ports = {p["name"]: p["containerPort"] for p in _pod(pre)["containers"][0]["ports"]}
    assert ports["kv-peer"] == 9123
    pols = ch.by_kind(objs, "NetworkPolicy")
    decode, prefill = ch._pod("demo", "worker", "decode"), ch._pod("demo", "worker", "prefill")
    assert ch.ingress_allowed(pols, decode, prefill, 9123)
    assert not ch.ingress_allowed(pols, decode, prefill, 8001)


def test_gateway_pdb_leaves_one_of_the_default_two(ch, monkeypatch):
    objs = ch.objects("cpu")
    [gw] = [o for o in _children(ch, objs, _defaults(ch, objs, monkeypatch))
            if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-gateway"]
    pdb = ch.one(objs, "PodDisruptionBudget", "demo-gateway")
    assert pdb["spec"]["minAvailable"] == 1 < gw["spec"]["replicas"]
    assert ch._selects(pdb["spec"]["selector"], gw["spec"]["template"]["metadata"]["labels"])


def test_an_upgrade_replaces_the_crd_with_the_new_operators(ch):
    """crds/ covers the install; a pre-upgrade Job runs the new image's `kvyard.operator.crd
    --apply`, allowed to touch that one CRD only."""
    import kubernetes_validate

    assert not [o for o in ch.objects("cpu") if o["kind"] == "Job" and "crd" in
                o["metadata"]["name"]]  # nothing cluster-wide extra on install
    out = ch.chart().render(copy.deepcopy(ch.PRESETS["cpu"]), name=ch.RELEASE,
                            namespace=ch.NAMESPACE, is_upgrade=True, revision=2)
    objs = [d for p, t in out.items() if p.endswith("crd-upgrade-hook.yaml")
            for d in yaml.safe_load_all(t) if d]
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding", "Job",
                                               "ServiceAccount"]
    for o in objs:
        assert o["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
        kubernetes_validate.validate(o, ch.K8S_VERSIONS[-1], strict=True)
    [job] = [o for o in objs if o["kind"] == "Job"]
    [c] = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][-3:] == ["-m", "kvyard.operator.crd", "--apply"]
    assert c["image"] == "ghcr.io/kvyard/kvyard:0.1.0"
    [role] = [o for o in objs if o["kind"] == "ClusterRole"]
    assert role["rules"] == [{"apiGroups": ["apiextensions.k8s.io"],
                              "resources": ["customresourcedefinitions"],
                              "resourceNames": ["inferenceservices.kvyard.io"],
                              "verbs": ["get", "update"]}]


def test_crd_apply_replaces_the_stored_crd_with_the_generated_one():
    import types

    from kubernetes.client.rest import ApiException

    from kvyard.operator import crd

    class Api:
        def __init__(self, stored):
            self.stored, self.calls = stored, []

        def read_custom_resource_definition(self, name):
            if self.stored is None:
                raise ApiException(status=404)
            return types.SimpleNamespace(metadata=types.SimpleNamespace(resource_version="7"))

        def replace_custom_resource_definition(self, name, body):
            self.calls.append(("replace", name, body))

        def create_custom_resource_definition(self, body):
            self.calls.append(("create", body["metadata"]["name"], body))

    api = Api(stored={})
    assert crd.apply_crd(api) == "replaced"
    [(verb, name, body)] = api.calls
    assert (verb, name, body["metadata"]["resourceVersion"]) == ("replace",
                                                                 "inferenceservices.kvyard.io", "7")
    assert body["spec"] == crd.crd_manifest()["spec"]
    api = Api(stored=None)
    assert crd.apply_crd(api) == "created" and api.calls[0][0] == "create"
