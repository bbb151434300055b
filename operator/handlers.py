"""kopf wiring: which events run a reconcile pass, and with what settings.

Every cause (resume after a restart, create, update, and a resync daemon) runs the
same idempotent pass (`reconcile.reconcile`), one at a time per object. The status
follows the children through watches, not polling: kopf watches the operator's
Deployments and pods (label `app.kubernetes.io/managed-by: kvyard-operator`, a
server-side label selector); each event updates the view (watch.py) and wakes the
service's daemon, which recomputes the status from the view (`reconcile.refresh`: at
most one status patch, no reads), coalescing the events of `rollout_poll_s`. A
Deployment deleted by hand wakes a full pass; otherwise the daemon passes again every
`resync_s`, however many events came between (drift repair of every kind). There is
no delete handler: children carry owner references, so Kubernetes' garbage collector
removes them, with or without the operator running. kopf adds its finalizer for the
daemon and releases it itself when the object is deleted. kopf's bookkeeping lives in
annotations, so `status` is kvyard's alone.
"""
from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvyard.common import wire

from .client import Client, Connection
from .reconcile import Outcome, Retry, reconcile, refresh
from .spec import Defaults
from .watch import Children

SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
RESOURCE = (wire.K8S_GROUP, wire.CRD_VERSION, wire.CRD_PLURAL)


@dataclass(slots=True)
class OperatorConfig:
    resync_s: float = 30.0
    retry_s: float = 5.0
    rollout_poll_s: float = 1.0  # a burst of watch events shorter than this: one refresh
    server: str | None = None   # an API URL used without credentials (tests, kubectl proxy)
    defaults: Defaults = field(default_factory=Defaults)  # image and pull policy


@dataclass(slots=True)
class State:
    """Shared by every handler (kopf gives each object a shallow copy of the memo)."""

    config: OperatorConfig
    connection: Connection | None = None
    client: Client | None = None
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    children: Children = field(default_factory=Children)   # what the watches saw
    outcomes: dict[str, Outcome] = field(default_factory=dict)   # last pass, by uid

    def api(self) -> Client:
        if self.client is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in yet", delay=1)
            self.client = Client(self.connection)
        return self.client


def _pem_file(data: str | bytes | None) -> str | None:
    if not data:
        return None
    fd, path = tempfile.mkstemp(prefix="kvyard-operator-", suffix=".pem")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data if isinstance(data, bytes) else data.encode())
    return path


def connection_from(info: kopf.ConnectionInfo) -> Connection:
    ca = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
    return Connection(server=info.server, token=info.token,
                      token_path=SA_TOKEN if info.server == "https://kubernetes.default.svc"
                      else None,
                      ca_path=str(info.ca_path) if info.ca_path else None, ca_data=ca,
                      insecure=bool(info.insecure),
                      cert_path=str(info.certificate_path) if info.certificate_path
                      else _pem_file(info.certificate_data),
                      key_path=str(info.private_key_path) if info.private_key_path
                      else _pem_file(info.private_key_data))


class _QuietWatches(logging.Filter):
    """kopf logs every watch event's handler as succeeded at INFO: one line per pod change."""

    QUIET = ("Handler 'deployments' succeeded.", "Handler 'pods' succeeded.")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.QUIET


def configure(settings: kopf.OperatorSettings, cfg: OperatorConfig) -> None:
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _QuietWatches) for f in objects.filters):
        objects.addFilter(_QuietWatches())
    # The CRD is installed before the operator (the chart's crds/) and the namespaces
    # are given, so kopf needs no watch on CRDs or namespaces (nor the RBAC for them).
    settings.scanning.disabled = True
    settings.persistence.finalizer = f"{wire.K8S_GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=wire.K8S_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=wire.K8S_GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    # The Deployments and pods watched are the operator's own: filtered by the API server.
    managed = f"{wire.MANAGED_BY_LABEL}={wire.MANAGED_BY}"
    settings.watching.label_selectors["deployments"] = managed
    settings.watching.label_selectors["pods"] = managed
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30


def build_registry(cfg: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, cfg)

    @kopf.on.login(registry=registry)
    def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
        if cfg.server:
            info = kopf.ConnectionInfo(server=cfg.server)
        else:
            info = kopf.login_with_service_account(**kwargs) \
                or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            state: State = memo.state
            state.connection = connection_from(info)
            if state.client is not None:
                state.client.conn = state.connection
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if memo.state.client is not None:
            await memo.state.client.close()
            memo.state.client = None

    async def run_pass(body: kopf.Body, memo: kopf.Memo, logger: Any, full: bool = True,
                       **_: Any) -> dict[str, Any] | None:
        """One pass, or only the status from the watched view (`full=False`, when the last
        pass was for this generation); returns the status (None: the object is gone)."""
        state: State = memo.state
        md = body.metadata
        uid = md.uid or f"{md.namespace}/{md.name}"
        lock = state.locks.setdefault(uid, asyncio.Lock())
        async with lock:
            api = state.api()
            last = state.outcomes.get(uid)
            try:
                generation = body.get("metadata", {}).get("generation")
                if not full and last is not None and last.observed is not None \
                        and last.observed.generation == generation and not md.deletion_timestamp:
                    out = await refresh(api, md.namespace, md.name, last, state.children)
                else:
                    # The freshest object: the daemon's or a queued handler's body may be stale.
                    fresh = await api.get(wire.CRD_KIND, md.namespace, md.name)
                    if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
                        return None
                    out = await reconcile(api, fresh, cfg.defaults, state.children)
            except Retry as e:
                raise kopf.TemporaryError(str(e), delay=cfg.retry_s) from e
            state.outcomes[uid] = out
        new = out.status
        ready = next((c for c in new.get("conditions", []) if c["type"] == "Ready"), {})
        logger.debug("pass done: Ready=%s (%s)", ready.get("status"), ready.get("reason"))
        return new

    async def handle(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        # Returns None: kopf would store a result under status.<handler id>, a field the
        # CRD does not declare; the pass writes the declared status itself.
        await run_pass(body, memo, logger)

    def seen(kind: str) -> Any:
        def record(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
            memo.state.children.seen(kind, event.get("type"), event.get("object") or {})
        return record

    managed = {wire.MANAGED_BY_LABEL: wire.MANAGED_BY}
    kopf.on.event(group="apps", version="v1", plural="deployments", labels=managed,
                  id="deployments", registry=registry)(seen("Deployment"))
    kopf.on.event(group="", version="v1", plural="pods", labels=managed, id="pods",
                  registry=registry)(seen("Pod"))

    for reason, decorator in (("resume", kopf.on.resume), ("create", kopf.on.create),
                              ("update", kopf.on.update)):
        decorator(*RESOURCE, id=f"reconcile-{reason}", registry=registry,
                  backoff=cfg.retry_s)(handle)

    @kopf.daemon(*RESOURCE, id="resync", cancellation_timeout=5.0, registry=registry)
    async def resync(body: kopf.Body, memo: kopf.Memo, logger: Any, stopped: kopf.DaemonStopped,
                     **_: Any) -> None:
        # kopf cancels the wait when the object goes or the operator stops (a pass cut
        # short that way is completed by the next, like after a restart).
        state: State = memo.state
        key = (body.metadata.namespace or "default", body.metadata.name or "")
        changed = state.children.event(key)
        loop = asyncio.get_running_loop()
        # A full pass every resync_s however many watch events come in between.
        due = loop.time() + cfg.resync_s
        try:
            while not stopped:
                try:
                    await asyncio.wait_for(changed.wait(), timeout=max(0.0, due - loop.time()))
                    await asyncio.sleep(cfg.rollout_poll_s)  # the rest of the burst
                except asyncio.TimeoutError:
                    pass
                changed.clear()
                full = loop.time() >= due or key in state.children.full
                state.children.full.discard(key)
                try:
                    await run_pass(body, memo, logger, full=full)
                except kopf.TemporaryError as e:
                    logger.warning("resync: %s", e)
                    due = loop.time() + cfg.retry_s
                    continue
                if full:
                    due = loop.time() + cfg.resync_s
        finally:
            # The view stays: a service recreated under the same name (a new daemon) shares
            # its key, and the garbage collector's DELETED events empty it anyway.
            state.outcomes.pop(body.metadata.uid or "", None)

    return registry


async def run_operator(cfg: OperatorConfig, namespaces: list[str], clusterwide: bool,
                       liveness: str | None = None,
                       stop_flag: asyncio.Event | None = None,
                       ready_flag: asyncio.Event | None = None) -> None:
    """kopf's operator loop with kvyard's registry; returns when stop_flag is set."""
    await kopf.operator(registry=build_registry(cfg), standalone=True,
                        namespaces=namespaces, clusterwide=clusterwide,
                        liveness_endpoint=liveness, memo=kopf.Memo(state=State(cfg)),
                        stop_flag=stop_flag, ready_flag=ready_flag)
