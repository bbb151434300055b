"""`kvyard operator`: run the InferenceService operator (kopf).

In a pod it logs in with its service account; outside, with the kubeconfig
(`$KVYARD_OPERATOR_SERVER`, e.g. `kubectl proxy`'s URL, skips credentials).
"""
from __future__ import annotations

import argparse
import os

from kvyard.common.wire import WORKER_KV_PEER_PORT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", action="append", default=[],
                   help="watch InferenceServices here (repeatable; default: $WATCH_NAMESPACE, "
                        "else all namespaces)")
    p.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument("--resync-seconds", type=float, default=30.0,
                   help="every object is reconciled again this often (drift repair)")
    p.add_argument("--rollout-poll-seconds", type=float, default=1.0,
                   help="how long watch events on an object's Deployments and pods are gathered "
                        "into one status refresh")
    p.add_argument("--retry-seconds", type=float, default=5.0,
                   help="delay before a pass that hit an API error runs again")
    p.add_argument("--liveness", default="http://0.0.0.0:8081/healthz",
                   help="kopf's liveness endpoint ('' for none)")
    p.add_argument("--server", default=os.environ.get("KVYARD_OPERATOR_SERVER"),
                   help="API server URL used without credentials (kubectl proxy)")
    p.add_argument("--image", default=os.environ.get("KVYARD_IMAGE") or None,
                   help="kvyard's image for the EPP, the gateway and kvyard workers (default: "
                        "$KVYARD_IMAGE, else ghcr.io/kvyard/kvyard:<version>)")
    p.add_argument("--image-pull-policy", choices=("Always", "IfNotPresent", "Never"),
                   default=os.environ.get("KVYARD_IMAGE_PULL_POLICY") or "IfNotPresent")
    p.add_argument("--cuda-image", default=os.environ.get("KVYARD_CUDA_IMAGE") or None,
                   help="kvyard's CUDA image for workers on device cuda (default: "
                        "$KVYARD_CUDA_IMAGE, else --image, else ghcr.io/kvyard/kvyard:<version>-cuda)")
    p.add_argument("--image-pull-secret", action="append",
                   default=[n for n in os.environ.get("KVYARD_IMAGE_PULL_SECRETS", "").split(",")
                            if n.strip()],
                   help="a Secret every created pod pulls with (repeatable; default: "
                        "$KVYARD_IMAGE_PULL_SECRETS, comma-separated)")
    p.add_argument("--pod-service-account",
                   default=os.environ.get("KVYARD_POD_SERVICE_ACCOUNT") or None,
                   help="ServiceAccount of the workers and gateways it creates")
    p.add_argument("--kv-peer-port", type=int,
                   default=int(os.environ.get("KVYARD_KV_PEER_PORT") or WORKER_KV_PEER_PORT),
                   help="the workers' P/D KV transfer port (default: $KVYARD_KV_PEER_PORT, else 8001)")
    p.add_argument("--cluster-domain", default=os.environ.get("KVYARD_CLUSTER_DOMAIN")
                   or "cluster.local", help="the cluster's DNS domain (default: "
                                            "$KVYARD_CLUSTER_DOMAIN, else cluster.local)")
    g = p.add_argument_group("TLS on the EPPs' ext_proc and scaler (render_tls.py; off by default)")
    g.add_argument("--epp-tls-secret", default=os.environ.get("KVYARD_EPP_TLS_SECRET") or None,
                   metavar="NAME", help="a Secret (tls.crt, tls.key, ca.crt) in each service's "
                                        "namespace (default: $KVYARD_EPP_TLS_SECRET)")
    g.add_argument("--epp-tls-issuer", default=os.environ.get("KVYARD_EPP_TLS_ISSUER") or None,
                   metavar="[GROUP/]KIND/NAME",
                   help="cert-manager issuer for a Certificate per service, its Secret "
                        "<service>-epp-tls (default: $KVYARD_EPP_TLS_ISSUER), e.g. "
                        "ClusterIssuer/kvyard-ca")
    g.add_argument("--epp-tls-mutual", action="store_true",
                   default=os.environ.get("KVYARD_EPP_TLS_MUTUAL", "").lower() in ("1", "true"),
                   help="the EPP asks clients (the gateway, KEDA) for a certificate of the CA")
    g.add_argument("--epp-tls-trigger-auth",
                   default=os.environ.get("KVYARD_EPP_TLS_TRIGGER_AUTH") or None,
                   metavar="[KIND/]NAME",
                   help="KEDA's authenticationRef on every ScaledObject trigger: the "
                        "(Cluster)TriggerAuthentication with caCert (and tlsClientCert/Key); "
                        "kind default ClusterTriggerAuthentication")
    p.add_argument("--log-level", default="info")


def _ref(value: str | None, fields: tuple[str, ...], default_kind: str) -> dict[str, str] | None:
    """'[group/]kind/name' (or 'name' with the default kind) as a reference object."""
    if not value:
        return None
    parts = value.split("/")
    if len(parts) == 1:
        parts = [default_kind, *parts]
    if len(parts) > len(fields) or not all(parts):
        raise SystemExit(f"kvyard operator: bad reference {value!r}: want "
                         f"{'/'.join(reversed(fields)).upper()}")
    return dict(zip(fields, reversed(parts)))


def epp_tls(args: argparse.Namespace):
    """The Defaults' EppTls from the flags; None when neither a Secret nor an issuer."""
    from .spec import EppTls

    if not (args.epp_tls_secret or args.epp_tls_issuer):
        if args.epp_tls_mutual or args.epp_tls_trigger_auth:
            raise SystemExit("kvyard operator: --epp-tls-mutual/--epp-tls-trigger-auth need "
                             "--epp-tls-secret or --epp-tls-issuer")
        return None
    if args.epp_tls_secret and args.epp_tls_issuer:
        raise SystemExit("kvyard operator: --epp-tls-secret or --epp-tls-issuer, not both (with "
                         "an issuer each service's Secret is <service>-epp-tls)")
    issuer = _ref(args.epp_tls_issuer, ("name", "kind", "group"), "ClusterIssuer")
    if issuer is not None:
        issuer.setdefault("group", "cert-manager.io")
    return EppTls(secret_name=args.epp_tls_secret, issuer=issuer, mutual=args.epp_tls_mutual,
                  trigger_auth=_ref(args.epp_tls_trigger_auth, ("name", "kind"),
                                    "ClusterTriggerAuthentication"))


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .handlers import OperatorConfig, run_operator
    from .spec import Defaults

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    namespaces = list(args.namespace)
    if not namespaces and not args.all_namespaces and os.environ.get("WATCH_NAMESPACE"):
        namespaces = [n.strip() for n in os.environ["WATCH_NAMESPACE"].split(",") if n.strip()]
    cfg = OperatorConfig(resync_s=args.resync_seconds, retry_s=args.retry_seconds,
                         rollout_poll_s=args.rollout_poll_seconds,
                         server=args.server,
                         defaults=Defaults(args.image, args.image_pull_policy,
                                           cuda_image=args.cuda_image,
                                           image_pull_secrets=[n.strip() for n in
                                                               args.image_pull_secret],
                                           service_account=args.pod_service_account,
                                           kv_peer_port=args.kv_peer_port,
                                           cluster_domain=args.cluster_domain,
                                           epp_tls=epp_tls(args)))
    asyncio.run(run_operator(cfg, namespaces, clusterwide=not namespaces,
                             liveness=args.liveness or None))
    return 0
