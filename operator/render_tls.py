"""TLS between the gateway, KEDA and the EPP (off unless the operator's Defaults.epp_tls).

One Secret per service holds tls.crt, tls.key and ca.crt: the user's (`--epp-tls-secret`,
in the service's namespace) or the one cert-manager writes for the `Certificate` rendered
here (`--epp-tls-issuer`), whose names are the EPP Service's, short and fully qualified
in the cluster domain (Envoy checks `<epp>.<ns>.svc`, KEDA the scaler address). The EPP
mounts it whole and serves ext_proc and the scaler over TLS (epp/tls.py reloads a renewed
certificate); the gateway mounts ca.crt (and, for mutual TLS, the certificate itself as
its client identity; Envoy reads these files at start). KEDA's side is an
`authenticationRef` on each trigger, to a (Cluster)TriggerAuthentication the chart writes
(the operator manages no KEDA kind besides ScaledObjects). The health port stays plaintext:
the kubelet's gRPC probes speak no TLS.
"""
from __future__ import annotations

from typing import Any

from . import render_common as rc
from .spec import EppTls, ServiceSpec

CERT_MANAGER_API = "cert-manager.io/v1"
TLS_DIR = f"{rc.CONFIG_MOUNT}/tls"
VOLUME = "epp-tls"


def epp_tls(s: ServiceSpec) -> EppTls | None:
    return s.defaults.epp_tls


def secret_name(s: ServiceSpec) -> str:
    t = epp_tls(s)
    return (t.secret_name if t is not None and t.secret_name
            else f"{rc.name_of(s, 'epp')}-tls")


def dns_names(s: ServiceSpec) -> list[str]:
    n = rc.name_of(s, "epp")
    return [n, f"{n}.{s.namespace}", f"{n}.{s.namespace}.svc", rc.service_host(s, n)]


def certificate(s: ServiceSpec) -> dict[str, Any] | None:
    """cert-manager's Certificate for the EPP Service, when the operator has an issuer.
    Usages include client auth: in mutual mode the gateway presents the same certificate."""
    t = epp_tls(s)
    if t is None or not t.issuer:
        return None
    name = secret_name(s)
    return {"apiVersion": CERT_MANAGER_API, "kind": "Certificate",
            "metadata": rc.metadata(s, name, "epp"),
            "spec": {"secretName": name, "dnsNames": dns_names(s),
                     "issuerRef": dict(t.issuer),
                     "usages": ["digital signature", "key encipherment", "server auth",
                                "client auth"],
                     "privateKey": {"rotationPolicy": "Always"}}}


def epp_args(s: ServiceSpec) -> list[str]:
    t = epp_tls(s)
    if t is None:
        return []
    args = ["--tls-cert-file", f"{TLS_DIR}/tls.crt", "--tls-key-file", f"{TLS_DIR}/tls.key"]
    if t.mutual:
        args += ["--tls-client-ca-file", f"{TLS_DIR}/ca.crt"]
    return args


def volume(s: ServiceSpec, gateway: bool) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of the Secret: whole for the EPP; for the gateway just ca.crt
    unless mutual (it then presents the certificate as its own)."""
    t = epp_tls(s)
    if t is None:
        return [], []
    secret: dict[str, Any] = {"secretName": secret_name(s), "defaultMode": 0o440}
    if gateway and not t.mutual:
        secret["items"] = [{"key": "ca.crt", "path": "ca.crt"}]
    return ([{"name": VOLUME, "secret": secret}],
            [{"name": VOLUME, "mountPath": TLS_DIR, "readOnly": True}])


def gateway_options(s: ServiceSpec, epp_host: str) -> dict[str, Any]:
    """GatewayConfig's epp_tls_* fields (kvyard.gateway.config)."""
    t = epp_tls(s)
    if t is None:
        return {}
    out = {"epp_tls_ca_file": f"{TLS_DIR}/ca.crt", "epp_tls_sni": epp_host}
    if t.mutual:
        out |= {"epp_tls_cert_file": f"{TLS_DIR}/tls.crt",
                "epp_tls_key_file": f"{TLS_DIR}/tls.key"}
    return out


def authentication_ref(s: ServiceSpec) -> dict[str, str] | None:
    t = epp_tls(s)
    return dict(t.trigger_auth) if t is not None and t.trigger_auth else None
