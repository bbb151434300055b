"""The few Kubernetes API calls the operator makes, over aiohttp.

Server-side apply (field manager `kvyard-operator`, force: the operator owns its
children's fields and takes them back from a hand edit), get, create, delete,
list by label, and status patches. Credentials are the ones kopf logged in with
(`handlers.login`); in a pod the service-account token is re-read per request,
since the kubelet rotates it. `KINDS` is the only place that maps a kind to its
URL, so `rbac.py` can derive the permissions from it.
"""
from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvyard.common import wire

# kind -> (apiVersion, plural)
KINDS: dict[str, tuple[str, str]] = {
    "Deployment": ("apps/v1", "deployments"),
    "Service": ("v1", "services"),
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
    "Pod": ("v1", "pods"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferencePool": (f"{wire.INFERENCE_POOL_GROUP}/{wire.INFERENCE_POOL_VERSION}",
                      "inferencepools"),
    "ScaledObject": ("keda.sh/v1alpha1", "scaledobjects"),
    "Certificate": ("cert-manager.io/v1", "certificates"),
    wire.CRD_KIND: (f"{wire.K8S_GROUP}/{wire.CRD_VERSION}", wire.CRD_PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(slots=True)
class Connection:
    server: str
    token: str | None = None
    token_path: str | None = None   # re-read per request (rotated by the kubelet)
    ca_path: str | None = None
    ca_data: str | None = None
    insecure: bool = False
    cert_path: str | None = None    # client certificate (kubeconfigs such as kind's)
    key_path: str | None = None

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_path and Path(self.token_path).exists():
            token = Path(self.token_path).read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_path, cadata=self.ca_data)
        if self.cert_path:
            ctx.load_cert_chain(self.cert_path, self.key_path)
        return ctx


def path_of(kind: str, namespace: str, name: str | None = None) -> str:
    api, plural = KINDS[kind]
    base = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class Client:
    """One aiohttp session; every call raises ApiError on a non-2xx answer."""

    def __init__(self, conn: Connection, timeout_s: float = 10.0) -> None:
        self.conn = conn
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, body: Any = None,
                    content_type: str = "application/json",
                    params: dict[str, str] | None = None) -> Any:
        headers = {**self.conn.headers(), "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._session.request(method, self.conn.server.rstrip("/") + path,
                                         data=data, headers=headers, params=params,
                                         ssl=self.conn.ssl_context()) as resp:
            text = await resp.text()
            if resp.status >= 300:
                try:
                    message = json.loads(text).get("message") or text
                except ValueError:
                    message = text
                raise ApiError(resp.status, str(message)[:500])
            return json.loads(text) if text else {}

    async def apply(self, obj: dict[str, Any], manager: str = wire.FIELD_MANAGER,
                    force: bool = True) -> dict[str, Any]:
        """Server-side apply; without `force` a field another manager owns with another
        value is a 409 Conflict."""
        md = obj["metadata"]
        return await self._call("PATCH", path_of(obj["kind"], md["namespace"], md["name"]), obj,
                                "application/apply-patch+yaml",
                                {"fieldManager": manager, "force": "true" if force else "false"})

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", path_of(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, obj: dict[str, Any]) -> bool:
        """False when it already exists."""
        try:
            await self._call("POST", path_of(obj["kind"], obj["metadata"]["namespace"]), obj)
        except ApiError as e:
            if e.status == 409:
                return False
            raise
        return True

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await self._call("DELETE", path_of(kind, namespace, name),
                             {"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise

    async def list(self, kind: str, namespace: str, selector: dict[str, str]
                   ) -> list[dict[str, Any]]:
        sel = ",".join(f"{k}={v}" for k, v in selector.items())
        doc = await self._call("GET", path_of(kind, namespace), params={"labelSelector": sel})
        items = doc.get("items") or []
        # Filtered here too: a selector the server ignored must not widen a prune.
        return [i for i in items
                if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                       for k, v in selector.items())]

    async def patch_status(self, kind: str, namespace: str, name: str,
                           status: dict[str, Any]) -> None:
        await self._call("PATCH", path_of(kind, namespace, name) + "/status",
                         {"status": status}, "application/merge-patch+json")
