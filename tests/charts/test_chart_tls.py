"""charts/kvyard's `tls` values: lint clean; the operator's environment, parsed by `kvyard
operator`'s own parser, turns on the EPP's TLS in the children it renders (Secret mounted,
flags, Envoy's TLS context, the triggers' authenticationRef); KEDA's ClusterTriggerAuthentication
reads the CA (and a client certificate when mutual) from a Secret in KEDA's namespace, which
cert-manager writes when asked; the values are checked; off by default."""
from __future__ import annotations

import copy

import pytest
import yaml

import helm_python as helm

STZ = {"scaleToZero": {"enabled": True, "idleSeconds": 60},
       "pools": {"both": {"minReplicas": 0, "maxReplicas": 2}}}
SECRET = {"enabled": True, "secretName": "epp-cert"}
CERT_MANAGER = {"enabled": True, "mutual": True,
                "certManager": {"issuerRef": {"name": "kvyard-ca", "kind": "ClusterIssuer"}}}


def _values(ch, tls: dict) -> dict:
    values = copy.deepcopy(ch.PRESETS["cpu"])
    values["inferenceService"]["spec"] = {**values["inferenceService"].get("spec", {}), **STZ}
    values["tls"] = copy.deepcopy(tls)
    return values


def _objects(ch, values: dict) -> list[dict]:
    out = ch.chart().render(copy.deepcopy(values), name=ch.RELEASE, namespace=ch.NAMESPACE,
                            is_install=True)
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _children(ch, objs, monkeypatch) -> list[dict]:
    """What the chart's operator renders for its first InferenceService, its TLS settings
    parsed from its environment by `kvyard operator`'s parser."""
    from kvyard.cli import build_parser
    from kvyard.operator import cli as op_cli, render, spec as op_spec

    [c] = ch.one(objs, "Deployment", "kvyard-operator")["spec"]["template"]["spec"]["containers"]
    for name in ("SECRET", "ISSUER", "MUTUAL", "TRIGGER_AUTH"):
        monkeypatch.delenv(f"KVYARD_EPP_TLS_{name}", raising=False)
    for e in c["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    a = build_parser(c["args"]).parse_args(c["args"])
    d = op_spec.Defaults(cluster_domain=a.cluster_domain, epp_tls=op_cli.epp_tls(a))
    [isvc] = ch.by_kind(objs, "InferenceService")
    body = {**isvc, "metadata": {**isvc["metadata"], "uid": "u-1", "generation": 1}}
    return render.render_all(op_spec.parse(body, d))


@pytest.mark.parametrize("tls", [SECRET, CERT_MANAGER], ids=["secret", "cert-manager"])
def test_lint_clean(ch, tls):
    report = helm.lint(str(ch.CHART), _values(ch, tls), strict=True, namespace=ch.NAMESPACE)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_off_by_default(ch):
    for preset in ch.PRESETS:
        objs = ch.objects(preset)
        assert not ch.by_kind(objs, "ClusterTriggerAuthentication")
        assert not ch.by_kind(objs, "Certificate")
        env = ch.one(objs, "Deployment", "kvyard-operator")["spec"]["template"]["spec"][
            "containers"][0]["env"]
        assert not [e for e in env if e["name"].startswith("KVYARD_EPP_TLS")]


def test_a_user_secret_reaches_the_epp_the_gateway_and_keda(ch, monkeypatch):
    objs = _objects(ch, _values(ch, SECRET))
    auth = ch.one(objs, "ClusterTriggerAuthentication", "kvyard-epp-tls")
    assert auth["apiVersion"] == "keda.sh/v1alpha1"
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "caCert", "name": "epp-cert", "key": "ca.crt"}]
    assert not ch.by_kind(objs, "Certificate")
    children = _children(ch, objs, monkeypatch)
    epp = ch.one(children, "Deployment", "demo-epp")["spec"]["template"]["spec"]
    args = epp["containers"][0]["args"]
    assert args[args.index("--tls-cert-file") + 1] == "/etc/kvyard/tls/tls.crt"
    assert "--tls-client-ca-file" not in args
    assert {"name": "epp-tls", "secret": {"secretName": "epp-cert", "defaultMode": 0o440}} \
        in epp["volumes"]
    [so] = ch.by_kind(children, "ScaledObject")
    assert so["spec"]["triggers"][0]["authenticationRef"] == {
        "name": "kvyard-epp-tls", "kind": "ClusterTriggerAuthentication"}
    envoy = yaml.safe_load(ch.one(children, "ConfigMap", "demo-gateway")["data"]["envoy.yaml"])
    [epp_cluster] = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "kvyard_epp"]
    assert epp_cluster["transport_socket"]["typed_config"]["sni"] == f"demo-epp.{ch.NAMESPACE}.svc"


def test_cert_manager_and_mutual_tls(ch, monkeypatch):
    values = _values(ch, CERT_MANAGER)
    values["keda"] = {"namespace": "autoscaling", "operatorLabels": {"app": "keda-operator"}}
    objs = _objects(ch, values)
    [cert] = ch.by_kind(objs, "Certificate")  # KEDA's client certificate, in KEDA's namespace
    assert cert["metadata"] == {**cert["metadata"], "name": "kvyard-keda-client",
                                "namespace": "autoscaling"}
    assert cert["spec"]["secretName"] == "kvyard-keda-client"
    assert cert["spec"]["issuerRef"] == {"name": "kvyard-ca", "kind": "ClusterIssuer",
                                         "group": "cert-manager.io"}
    assert "client auth" in cert["spec"]["usages"]
    auth = ch.one(objs, "ClusterTriggerAuthentication", "kvyard-epp-tls")
    assert {(r["parameter"], r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]} == {
        ("caCert", "kvyard-keda-client", "ca.crt"),
        ("tlsClientCert", "kvyard-keda-client", "tls.crt"),
        ("tlsClientKey", "kvyard-keda-client", "tls.key")}
    children = _children(ch, objs, monkeypatch)
    svc_cert = ch.one(children, "Certificate", "demo-epp-tls")
    assert svc_cert["spec"]["issuerRef"] == {"name": "kvyard-ca", "kind": "ClusterIssuer",
                                             "group": "cert-manager.io"}
    assert f"demo-epp.{ch.NAMESPACE}.svc.cluster.local" in svc_cert["spec"]["dnsNames"]
    args = ch.one(children, "Deployment", "demo-epp")["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--tls-client-ca-file") + 1] == "/etc/kvyard/tls/ca.crt"
    # KEDA's side off (no KEDA CRDs): no trigger authentication, none referenced
    values["tls"]["keda"] = {"triggerAuthentication": False}
    objs = _objects(ch, values)
    assert not ch.by_kind(objs, "ClusterTriggerAuthentication")
    assert not ch.by_kind(objs, "Certificate")
    [so] = ch.by_kind(_children(ch, objs, monkeypatch), "ScaledObject")
    assert "authenticationRef" not in so["spec"]["triggers"][0]


@pytest.mark.parametrize("bad", [
    {"enabled": True},
    {"enabled": True, "secretName": "s", "certManager": {"issuerRef": {"name": "ca"}}},
    {"enabled": True, "secretName": "Not_A_Name"},
    {"enabled": True, "secretName": "s", "mutal": True},
    {"enabled": "yes", "secretName": "s"},
], ids=["no certificate", "both", "bad name", "unknown key", "not a boolean"])
def test_tls_values_are_checked(ch, bad):
    with pytest.raises(helm.HelmValuesError):
        ch.chart().validate_schema({"tls": copy.deepcopy(bad)})
