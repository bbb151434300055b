"""One reconcile pass: spec -> checks -> apply children -> prune -> status.

Idempotent: every pass applies the full rendered set with server-side apply, so a
child edited or deleted by hand is put back, and a pass cut short (an operator
restart) is completed by the next. A bad spec or a missing Secret ends as a
Degraded status, never an exception; only API failures that may pass (5xx,
timeouts, no connection) raise `Retry`, which the handlers turn into
`kopf.TemporaryError`.
The status comes from what the pass saw (the Deployments its applies returned, the
service's pods listed once); between passes `refresh` recomputes it from the watched
view (watch.py) without reading the API.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import secrets
import urllib.parse
from typing import Any

import aiohttp

from kvyard.common import wire

from . import render, status
from .client import ApiError, Client
from .handover import hand_over_replicas
from .render_workers import pd_secret_name
from .models import models_status
from .spec import Defaults, ServiceSpec, SpecError, parse
from .status import Observed, Problem
from .watch import Children

log = logging.getLogger("kvyard.operator")
# Kinds a pass may leave behind when the spec changes (a pool removed, the pool disabled).
_NETWORK = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
PRUNED_KINDS = ("Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
                "InferencePool", "ScaledObject", "Certificate")
_NO_KEDA = ("pools run at fixed replicas (spec.pools.*.replicas, at least 1) until KEDA "
            "is installed")


class Retry(Exception):
    """A failure that may pass: try the pass again later."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _transient(e: Exception) -> bool:
    return not isinstance(e, ApiError) or e.status >= 500 or e.status == 429


async def redis_reachable(url: str, timeout_s: float = 1.0) -> str | None:
    """None when a TCP connection to the URL's host:port opens; else why not."""
    u = urllib.parse.urlsplit(url.replace("redis+cluster://", "redis://", 1))
    host, port = u.hostname, u.port or 6379
    if not host:
        return f"no host in {url!r}"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as e:
        return f"{host}:{port}: {e.__class__.__name__} {e}".strip()
    writer.close()
    return None


async def preflight(api: Client, s: ServiceSpec) -> list[Problem]:
    kv = s.kvstore
    if kv is None or not kv.redis_url:
        return []
    problems = []
    if kv.redis_secret:
        secret = await api.get("Secret", s.namespace, kv.redis_secret)
        if secret is None:
            problems.append(Problem("SecretNotFound", f"Secret {kv.redis_secret} (the Redis "
                                    f"password) does not exist in {s.namespace}", True))
        elif kv.redis_secret_key not in (secret.get("data") or {}):
            problems.append(Problem("SecretKeyNotFound", f"Secret {kv.redis_secret} has no key "
                                    f"{kv.redis_secret_key!r}", True))
    why = await redis_reachable(kv.redis_url)
    if why:
        problems.append(Problem("RedisUnreachable", f"{why}; workers run without the Redis "
                                "tier until it answers"))
    return problems


async def keda_installed(api: Client, s: ServiceSpec) -> tuple[bool, list[Problem]]:
    """Does the cluster serve KEDA's ScaledObject API? Asked with the list a prune makes
    anyway (one call a pass, no discovery permissions); only autoscaled services ask."""
    if not s.autoscaled:
        return True, []
    try:
        await api.list("ScaledObject", s.namespace, {wire.SERVICE_LABEL: s.name})
    except ApiError as e:
        if _transient(e):
            raise
        if e.status == 404:
            return False, [Problem("KEDANotInstalled", "autoscaling needs KEDA's ScaledObject "
                                   f"CRD (keda.sh/v1alpha1), which is not installed; {_NO_KEDA}")]
        if e.status == 403:
            return False, [Problem("KEDAForbidden", "the operator may not list "
                                   f"scaledobjects.keda.sh ({e.message}); {_NO_KEDA}")]
        raise
    return True, []


async def ensure_pd_key(api: Client, s: ServiceSpec) -> None:
    """Created once with a random key, never rewritten (rotating it would break
    in-flight handoffs); deleted with the service through its owner reference."""
    if await api.get("Secret", s.namespace, pd_secret_name(s)) is None:
        await api.create(render.pd_key_secret(s, secrets.token_hex(32)))


@dataclasses.dataclass(slots=True)
class Outcome:
    """A pass's result: the status it wrote and what it was computed from."""

    status: dict[str, Any]
    observed: Observed | None = None    # None: nothing rendered (bad spec, object gone)
    deployments: list[str] = dataclasses.field(default_factory=list)   # names rendered


async def apply_children(api: Client, s: ServiceSpec, children: list[dict[str, Any]]
                         ) -> tuple[list[Problem], list[dict[str, Any]]]:
    """Problems, and the Deployments as the applies returned them (with their status)."""
    problems, deployments = [], []
    for obj in children:
        try:
            await hand_over_replicas(api, obj)
            live = await api.apply(obj)
            if obj["kind"] == "Deployment":
                deployments.append(live)
        except ApiError as e:
            if _transient(e):
                raise Retry(f"apply {obj['kind']}/{obj['metadata']['name']}: {e}") from e
            if obj["kind"] == "InferencePool" and e.status == 404:
                problems.append(Problem("InferencePoolCRDMissing", "inferencePool.enabled, but "
                                        "the GAIE InferencePool CRD is not installed"))
            elif obj["kind"] == "ScaledObject" and e.status == 404:
                problems.append(Problem("KEDANotInstalled", "KEDA's ScaledObject CRD went away "
                                        "during the pass"))
            elif obj["kind"] == "Certificate" and e.status == 404:
                problems.append(Problem("CertManagerNotInstalled", "the EPP's TLS certificate "
                                        "needs cert-manager's Certificate CRD (cert-manager.io/v1)"
                                        ", which is not installed"))
            else:
                problems.append(Problem("ApplyFailed", f"{obj['kind']}/{obj['metadata']['name']}:"
                                        f" {e.message}"))
    return problems, deployments


async def prune(api: Client, s: ServiceSpec, children: list[dict[str, Any]]) -> None:
    keep = {(o["kind"], o["metadata"]["name"]) for o in children}
    selector = {wire.MANAGED_BY_LABEL: wire.MANAGED_BY, wire.SERVICE_LABEL: s.name}
    for kind in PRUNED_KINDS:
        try:
            items = await api.list(kind, s.namespace, selector)
        except ApiError as e:
            if e.status == 404:  # an API that is not installed holds nothing of ours
                continue
            raise
        for item in items:
            md = item.get("metadata", {})
            owned = any(r.get("uid") == s.uid for r in md.get("ownerReferences") or [])
            if owned and (kind, md.get("name")) not in keep:
                log.info("%s/%s: pruning %s/%s", s.namespace, s.name, kind, md.get("name"))
                await api.delete(kind, s.namespace, md["name"])


async def observe(api: Client, s: ServiceSpec, children: list[dict[str, Any]],
                  problems: list[Problem], keda: bool = True,
                  applied: list[dict[str, Any]] | None = None,
                  view: Children | None = None) -> Observed:
    """`applied`: the Deployments as this pass's applies returned them; the others (none
    applied: a blocking problem; an apply that failed) are read."""
    names = [o["metadata"]["name"] for o in children if o["kind"] == "Deployment"]
    by_name = {d.get("metadata", {}).get("name"): d for d in applied or []}
    seen = []
    for name in names:
        got = by_name.get(name) or await api.get("Deployment", s.namespace, name)
        if got is not None:
            seen.append(got)
    pods = await api.list("Pod", s.namespace, {wire.MANAGED_BY_LABEL: wire.MANAGED_BY,
                                               wire.SERVICE_LABEL: s.name})
    if view is not None:
        view.seed((s.namespace, s.name), "Deployment", seen)
        view.seed((s.namespace, s.name), "Pod", pods, complete=True)
    return Observed(generation=s.generation, deployments=seen, problems=problems,
                    gateway_address=render.gateway_address(s), expected_deployments=len(names),
                    wakes_from_zero=s.scale_to_zero and keda, pods=pods,
                    models=models_status(s))


def _status_patch(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """A merge patch that also removes pools that are gone."""
    pools = dict(new.get("pools", {}))
    for role in (old.get("pools") or {}):
        pools.setdefault(role, None)
    return {**new, "pools": pools}


def _same(new: dict[str, Any], old: dict[str, Any]) -> bool:
    return all(old.get(k) == v for k, v in new.items())


async def _write_status(api: Client, ns: str, name: str, obs: Observed,
                        old: dict[str, Any]) -> dict[str, Any]:
    new = status.compute(obs, old.get("conditions"), _now())
    if not _same(new, old):
        await api.patch_status(wire.CRD_KIND, ns, name, _status_patch(new, old))
    return new


def _api_failure(e: Exception, ns: str, name: str) -> bool:
    """Raise Retry for what may pass; True for a 404 (the object went while we worked)."""
    if isinstance(e, _NETWORK):
        raise Retry(f"{e.__class__.__name__}: {e}") from e
    if isinstance(e, ApiError) and _transient(e):
        raise Retry(str(e)) from e
    if isinstance(e, ApiError) and e.status == 404:  # its children go with it
        log.info("%s/%s: gone (%s)", ns, name, e)
        return True
    return False


async def refresh(api: Client, ns: str, name: str, last: Outcome, view: Children) -> Outcome:
    """The status again from the watched view and the last pass's findings (no reads)."""
    if last.observed is None:
        return last
    key = (ns, name)
    obs = dataclasses.replace(last.observed, deployments=view.of(key, "Deployment",
                                                                 last.deployments),
                              pods=view.of(key, "Pod"))
    try:
        new = await _write_status(api, ns, name, obs, last.status)
    except (ApiError, *_NETWORK) as e:
        if _api_failure(e, ns, name):
            return last
        raise
    return Outcome(new, obs, last.deployments)


async def reconcile(api: Client, body: dict[str, Any], defaults: Defaults | None = None,
                    view: Children | None = None) -> Outcome:
    """One pass over a custom resource as the API returned it; `view` (the watched
    children) is seeded with what the pass read."""
    meta = body.get("metadata") or {}
    ns, name = meta.get("namespace") or "default", meta.get("name", "")
    old = dict(body.get("status") or {})
    names: list[str] = []
    try:
        try:
            s = parse(body, defaults)
        except SpecError as e:
            obs = Observed(generation=int(meta.get("generation") or 1),
                           problems=[Problem("InvalidSpec", str(e), True)])
            return Outcome(await _write_status(api, ns, name, obs, old))
        problems = await preflight(api, s)
        keda, why = await keda_installed(api, s)
        problems += why
        children = render.render_all(s, keda)
        names = [o["metadata"]["name"] for o in children if o["kind"] == "Deployment"]
        applied = None
        if not any(p.blocking for p in problems):
            if s.disaggregated:
                await ensure_pd_key(api, s)
            more, applied = await apply_children(api, s, children)
            problems += more
            await prune(api, s, children)
        obs = await observe(api, s, children, problems, keda, applied, view)
        return Outcome(await _write_status(api, ns, name, obs, old), obs, names)
    except (ApiError, *_NETWORK) as e:
        if _api_failure(e, ns, name):
            return Outcome(old)
        raise
