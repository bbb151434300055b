"""TLS on the EPP's ext_proc and scaler, as the operator renders it (render_tls.py): off by
default; with a user Secret or a cert-manager issuer the EPP mounts the Secret and gets the
flags, the gateway's Envoy trusts the CA (and presents the certificate when mutual), the
ScaledObjects' triggers name KEDA's TriggerAuthentication, and cert-manager gets a
Certificate for the EPP Service's names; the operator's flags build it all."""
from __future__ import annotations

import argparse

import kubernetes_validate
import pytest
import yaml

from kvyard.cli import build_parser
from kvyard.operator import cli as op_cli
from kvyard.operator.render import render_all
from kvyard.operator.spec import Defaults, EppTls, parse

UID = "0b6f3a52-1c1e-4a57-9d7e-5f1c2d3e4f50"
STZ = {"scaleToZero": {"enabled": True, "idleSeconds": 120},
       "pools": {"decode": {"minReplicas": 0, "maxReplicas": 2}}}
ISSUER = {"name": "kvyard-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
AUTH = {"name": "kvyard-epp-tls", "kind": "ClusterTriggerAuthentication"}


def children(tls: EppTls | None, spec: dict | None = None) -> list[dict]:
    d = Defaults(cluster_domain="corp.internal", epp_tls=tls)
    return render_all(parse({"metadata": {"name": "demo", "namespace": "team-a", "uid": UID,
                                          "generation": 1}, "spec": spec or STZ}, d))


def one(objs: list[dict], kind: str, name: str) -> dict:
    (o,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


def pod(objs: list[dict], name: str) -> dict:
    return one(objs, "Deployment", name)["spec"]["template"]["spec"]


def envoy(objs: list[dict]) -> dict:
    return yaml.safe_load(one(objs, "ConfigMap", "demo-gateway")["data"]["envoy.yaml"])


def epp_cluster(objs: list[dict]) -> dict:
    return next(c for c in envoy(objs)["static_resources"]["clusters"] if c["name"] == "kvyard_epp")


def test_off_by_default() -> None:
    objs = children(None)
    assert not [o for o in objs if o["kind"] == "Certificate"]
    assert "--tls-cert-file" not in pod(objs, "demo-epp")["containers"][0]["args"]
    assert "transport_socket" not in epp_cluster(objs)
    (trigger,) = one(objs, "ScaledObject", "demo-decode")["spec"]["triggers"]
    assert "authenticationRef" not in trigger


def test_a_user_secret_is_mounted_and_served() -> None:
    objs = children(EppTls(secret_name="epp-cert", trigger_auth=AUTH))
    assert not [o for o in objs if o["kind"] == "Certificate"]  # the Secret is the user's
    epp = pod(objs, "demo-epp")
    (c,) = epp["containers"]
    a = build_parser(c["args"]).parse_args(c["args"])  # the real `kvyard epp` parser
    assert (a.tls_cert_file, a.tls_key_file, a.tls_client_ca_file) == (
        "/etc/kvyard/tls/tls.crt", "/etc/kvyard/tls/tls.key", None)
    assert {"name": "epp-tls", "secret": {"secretName": "epp-cert", "defaultMode": 0o440}} \
        in epp["volumes"]
    assert {"name": "epp-tls", "mountPath": "/etc/kvyard/tls", "readOnly": True} \
        in c["volumeMounts"]
    # probes stay plaintext gRPC health; the TLS ports are no longer h2c
    assert c["readinessProbe"]["grpc"] == {"port": 9003}
    ports = one(objs, "Service", "demo-epp")["spec"]["ports"]
    assert not [p for p in ports if "appProtocol" in p]
    # the gateway: only ca.crt, and Envoy checks the EPP Service's name
    gw = pod(objs, "demo-gateway")
    assert {"name": "epp-tls", "secret": {"secretName": "epp-cert", "defaultMode": 0o440,
                                          "items": [{"key": "ca.crt", "path": "ca.crt"}]}} \
        in gw["volumes"]
    assert {"name": "epp-tls", "mountPath": "/etc/kvyard/tls", "readOnly": True} \
        in gw["containers"][0]["volumeMounts"]
    tls = epp_cluster(objs)["transport_socket"]["typed_config"]
    assert tls["sni"] == "demo-epp.team-a.svc"
    assert tls["common_tls_context"]["validation_context"]["trusted_ca"] == {
        "filename": "/etc/kvyard/tls/ca.crt"}
    assert "tls_certificates" not in tls["common_tls_context"]
    # KEDA: the scaler address in the cluster domain, TLS through the TriggerAuthentication
    (trigger,) = one(objs, "ScaledObject", "demo-decode")["spec"]["triggers"]
    assert trigger["authenticationRef"] == AUTH
    assert trigger["metadata"]["scalerAddress"] == "demo-epp.team-a.svc.corp.internal:9004"
    for kind in ("Deployment", "Service"):
        for o in objs:
            if o["kind"] == kind:
                kubernetes_validate.validate(o, "1.33", strict=True)


def test_mutual_tls_gives_the_epp_the_ca_and_envoy_a_certificate() -> None:
    objs = children(EppTls(secret_name="epp-cert", mutual=True, trigger_auth=AUTH))
    args = pod(objs, "demo-epp")["containers"][0]["args"]
    a = build_parser(args).parse_args(args)
    assert a.tls_client_ca_file == "/etc/kvyard/tls/ca.crt"
    gw = pod(objs, "demo-gateway")
    vol = next(v for v in gw["volumes"] if v["name"] == "epp-tls")
    assert "items" not in vol["secret"]  # the certificate is Envoy's client identity too
    common = epp_cluster(objs)["transport_socket"]["typed_config"]["common_tls_context"]
    assert common["tls_certificates"] == [{
        "certificate_chain": {"filename": "/etc/kvyard/tls/tls.crt"},
        "private_key": {"filename": "/etc/kvyard/tls/tls.key"}}]


def test_cert_manager_certificate_for_the_epp_services_names() -> None:
    objs = children(EppTls(issuer=ISSUER, trigger_auth=AUTH))
    cert = one(objs, "Certificate", "demo-epp-tls")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    assert cert["metadata"]["ownerReferences"][0]["uid"] == UID  # deleted with the service
    assert cert["spec"]["secretName"] == "demo-epp-tls"
    assert cert["spec"]["issuerRef"] == ISSUER
    assert cert["spec"]["dnsNames"] == ["demo-epp", "demo-epp.team-a", "demo-epp.team-a.svc",
                                        "demo-epp.team-a.svc.corp.internal"]
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    vol = next(v for v in pod(objs, "demo-epp")["volumes"] if v["name"] == "epp-tls")
    assert vol["secret"]["secretName"] == "demo-epp-tls"
    kinds = [o["kind"] for o in objs]
    assert kinds.index("Certificate") < kinds.index("Deployment", kinds.index("ConfigMap"))


def test_without_autoscaling_no_scaled_object_and_still_tls() -> None:
    objs = children(EppTls(secret_name="s"), {"pools": {"both": {}}})
    assert not [o for o in objs if o["kind"] == "ScaledObject"]
    assert "transport_socket" in epp_cluster(objs)


def _flags(*argv: str):
    p = argparse.ArgumentParser()
    op_cli.add_arguments(p)
    return op_cli.epp_tls(p.parse_args(list(argv)))


def test_operator_flags_and_environment(monkeypatch) -> None:
    assert _flags() is None
    assert _flags("--epp-tls-issuer", "ClusterIssuer/kvyard-ca", "--epp-tls-mutual",
                  "--epp-tls-trigger-auth", "kvyard-epp-tls") == EppTls(
        issuer=ISSUER, mutual=True, trigger_auth=AUTH)
    assert _flags("--epp-tls-secret", "s", "--epp-tls-trigger-auth",
                  "TriggerAuthentication/t").trigger_auth == {"name": "t",
                                                              "kind": "TriggerAuthentication"}
    assert _flags("--epp-tls-issuer", "example.io/Issuer/x").issuer == {
        "name": "x", "kind": "Issuer", "group": "example.io"}
    for bad in (["--epp-tls-mutual"], ["--epp-tls-secret", "s", "--epp-tls-issuer", "Issuer/x"],
                ["--epp-tls-issuer", "Kind/name/extra/part"], ["--epp-tls-issuer", "Issuer/"]):
        with pytest.raises(SystemExit):
            _flags(*bad)
    monkeypatch.setenv("KVYARD_EPP_TLS_SECRET", "from-env")
    monkeypatch.setenv("KVYARD_EPP_TLS_MUTUAL", "true")
    monkeypatch.setenv("KVYARD_EPP_TLS_TRIGGER_AUTH", "kvyard-epp-tls")
    assert _flags() == EppTls(secret_name="from-env", mutual=True, trigger_auth=AUTH)


# --- through the real handlers against the emulated API ------------------------------------

async def test_the_certificate_is_applied_and_pruned_with_tls(api, kube, wait_for) -> None:
    import asyncio
    import contextlib

    from kvyard.operator.handlers import OperatorConfig, run_operator

    @contextlib.asynccontextmanager
    async def operator(tls: EppTls | None):
        stop = asyncio.Event()
        cfg = OperatorConfig(resync_s=0.3, retry_s=0.2, rollout_poll_s=0.2, server=str(api.url),
                             defaults=Defaults(epp_tls=tls))
        task = asyncio.create_task(run_operator(cfg, ["default"], clusterwide=False,
                                                stop_flag=stop))
        try:
            yield task
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)

    certs = lambda: {o["metadata"]["name"]: o for o in api.live("certificates")}  # noqa: E731
    async with operator(EppTls(issuer=ISSUER, trigger_auth=AUTH)):
        await kube.create("demo", STZ)
        await wait_for(lambda: "demo-epp-tls" in certs(), what="Certificate applied")
        assert certs()["demo-epp-tls"]["spec"]["dnsNames"][-1] == \
            "demo-epp.default.svc.cluster.local"
        so = await wait_for(lambda: api.get_live("scaledobjects", "default", "demo-decode"))
        assert so["spec"]["triggers"][0]["authenticationRef"] == AUTH
    async with operator(None):  # TLS turned off: the Certificate goes, the EPP is plaintext
        await wait_for(lambda: not certs(), what="Certificate pruned")
        await wait_for(lambda: "--tls-cert-file" not in api.get_live(
            "deployments", "default", "demo-epp")["spec"]["template"]["spec"]["containers"][0][
            "args"], what="EPP without TLS")
