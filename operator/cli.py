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
    p.add_argument("--log-level", default="info")


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
                                           cluster_domain=args.cluster_domain))
    asyncio.run(run_operator(cfg, namespaces, clusterwide=not namespaces,
                             liveness=args.liveness or None))
    return 0
