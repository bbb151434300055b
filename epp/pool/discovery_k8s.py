"""Endpoints from Kubernetes: Ready pods matching a label selector.

The official `kubernetes` client is synchronous, so list+watch runs in a
daemon thread and hands complete endpoint sets to the event loop with
`call_soon_threadsafe` (the pool is only ever touched from the loop). A pod
counts when it is Running, Ready, has a podIP and is not being deleted; a
pod that stops being Ready leaves the pool at once. Role comes from the
`kvyard.io/role` label (default both), the pool from `kvyard.io/pool` (several models
behind one EPP, epp/models.py), the port from `--target-port`.
On a watch error or a 410 Gone the thread re-lists, with capped backoff.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvyard.common.wire import POOL_LABEL, ROLE_LABEL, ROLES

from .endpoints import EndpointPool, EndpointSpec

log = logging.getLogger("kvyard.epp.k8s")
# Where a pod publishes its KV events (--kv-events-config endpoint / replay_endpoint ports);
# the EPP subscribes to the pod IP at these ports (epp/kvevents/sources.py).
KV_EVENTS_PORT_ANNOTATION = "kvyard.io/kv-events-port"
KV_REPLAY_PORT_ANNOTATION = "kvyard.io/kv-events-replay-port"


def pod_endpoint(pod: Any, target_port: int) -> EndpointSpec | None:
    """The endpoint a V1Pod stands for, or None when it must get no traffic."""
    md, st = pod.metadata, pod.status
    if md is None or st is None or md.deletion_timestamp is not None:
        return None
    if not st.pod_ip or st.phase != "Running":
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in (st.conditions or [])):
        return None
    role = (md.labels or {}).get(ROLE_LABEL, "both")
    if role not in ROLES:
        role = "both"
    host = f"[{st.pod_ip}]" if ":" in st.pod_ip else st.pod_ip
    ann = md.annotations or {}
    pub, rep = ann.get(KV_EVENTS_PORT_ANNOTATION), ann.get(KV_REPLAY_PORT_ANNOTATION)
    return EndpointSpec(f"{host}:{target_port}", role, pool=(md.labels or {}).get(POOL_LABEL, ""),
                        kv_events=f"tcp://{host}:{pub}" if pub and pub.isdigit() else None,
                        kv_replay=f"tcp://{host}:{rep}" if rep and rep.isdigit() else None)


def selector_string(selector: str) -> str:
    """Validates `key=value,...` (the CLI form) and returns it for the API."""
    parts = [p.strip() for p in selector.split(",") if p.strip()]
    for p in parts:
        if "=" not in p:
            raise ValueError(f"label selector part {p!r}: want key=value")
    return ",".join(parts)


@dataclass(slots=True)
class K8sDiscovery:
    namespace: str
    selector: str
    target_port: int
    pool: EndpointPool
    loop: asyncio.AbstractEventLoop
    source: str = "k8s"
    api_host: str | None = None  # e.g. http://127.0.0.1:8001 (kubectl proxy); None: in-cluster/kubeconfig
    _pods: dict[str, EndpointSpec] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _watch: Any = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="epp-k8s-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _publish(self) -> None:
        specs = list(self._pods.values())
        self.loop.call_soon_threadsafe(self.pool.set_source, self.source, specs)

    def _apply(self, pod: Any, deleted: bool) -> None:
        key = pod.metadata.uid or pod.metadata.name
        spec = None if deleted else pod_endpoint(pod, self.target_port)
        if spec is None:
            self._pods.pop(key, None)
        else:
            self._pods[key] = spec

    def _run(self) -> None:
        from kubernetes import client, config, watch

        if self.api_host:
            cfg = client.Configuration()
            cfg.host = self.api_host
            api = client.CoreV1Api(client.ApiClient(cfg))
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.CoreV1Api()
        backoff = 0.5
        while not self._stop.is_set():
            try:
                pods = api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                self._pods.clear()
                for p in pods.items:
                    self._apply(p, deleted=False)
                self._publish()
                backoff = 0.5
                self._watch = watch.Watch()
                for ev in self._watch.stream(api.list_namespaced_pod, self.namespace,
                                             label_selector=self.selector,
                                             resource_version=pods.metadata.resource_version,
                                             timeout_seconds=300):
                    self._apply(ev["object"], deleted=ev["type"] == "DELETED")
                    self._publish()
                    if self._stop.is_set():
                        break
            except Exception as e:  # noqa: BLE001 - re-list after any watch failure
                log.warning("pod watch failed (%s); re-listing in %.1fs", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
