"""Fixtures for the operator against an emulated API (kvyard.operator.testing on kmock):
the server, a client for the test's own calls, and the operator as a task."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import kmock
import pytest

from kvyard.operator.handlers import OperatorConfig, run_operator
from kvyard.operator.testing import ApiServer

NS = "default"
CRS = f"/apis/kvyard.io/v1alpha1/namespaces/{NS}/inferenceservices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "no_inference_pool_crd: the API lacks GAIE's CRD")
    config.addinivalue_line("markers", "no_keda_crd: the API lacks KEDA's ScaledObject CRD")


@pytest.fixture
async def api(request: pytest.FixtureRequest) -> AsyncIterator[ApiServer]:
    pools = "no_inference_pool_crd" not in request.keywords
    keda = "no_keda_crd" not in request.keywords
    async with ApiServer().declare(pools=pools, keda=keda) as handler, kmock.Server(handler):
        yield handler


class Kube:
    """The test's own API calls (what kubectl would do). A session per call: one kept
    across an operator's shutdown stopped getting connections."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api

    async def call(self, method: str, path: str, body: Any = None,
                   ctype: str = "application/merge-patch+json") -> dict:
        async with aiohttp.ClientSession() as session, session.request(
                method, str(self.api.url).rstrip("/") + path, json=body,
                headers={"Content-Type": ctype}) as r:
            assert r.status < 300, (r.status, await r.text())
            return await r.json()

    async def create(self, name: str, spec: dict, path: str = CRS) -> dict:
        return await self.call("POST", path, {
            "apiVersion": "kvyard.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}, "application/json")

    async def patch(self, path: str, body: dict) -> dict:
        return await self.call("PATCH", path, body)

    async def scale(self, deployment: str, replicas: int,
                    manager: str = "kube-controller-manager") -> dict:
        """What KEDA's HPA does: a write to the Deployment's scale subresource."""
        return await self.call("PATCH", f"{DEPLOYMENTS}/{deployment}/scale?fieldManager={manager}",
                               {"spec": {"replicas": replicas}})

    async def delete(self, path: str) -> dict:
        return await self.call("DELETE", path)

    def cr(self, name: str = "demo") -> dict | None:
        return self.api.get_live("inferenceservices", NS, name)

    def children(self, service: str = "demo") -> dict[tuple[str, str], dict]:
        return {(o["kind"], o["metadata"]["name"]): o for o in self.api.live()
                if (o["metadata"].get("labels") or {}).get("kvyard.io/service") == service}

    def condition(self, kind: str, name: str = "demo") -> dict:
        cr = self.cr(name) or {}
        return next((c for c in (cr.get("status") or {}).get("conditions", [])
                     if c["type"] == kind), {})


@pytest.fixture
def kube(api: ApiServer) -> Kube:
    return Kube(api)


async def until(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition",
                interval: float = 0.05) -> Any:
    """Poll `pred` (sync or async) until truthy or the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if isinstance(last, Awaitable):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise TimeoutError(f"{what} not reached in {timeout}s (last: {last!r})")


@pytest.fixture
def wait_for() -> Callable[..., Awaitable[Any]]:
    return until


@pytest.fixture
def operator(api: ApiServer) -> Callable[..., contextlib.AbstractAsyncContextManager]:
    """`async with operator(resync_s=...) as task:` the operator, stopped on exit."""
    @contextlib.asynccontextmanager
    async def run(resync_s: float = 0.5) -> AsyncIterator[asyncio.Task]:
        stop = asyncio.Event()
        cfg = OperatorConfig(resync_s=resync_s, retry_s=0.2, rollout_poll_s=0.2,
                             server=str(api.url))
        task = asyncio.create_task(run_operator(cfg, [NS], clusterwide=False, stop_flag=stop))
        try:
            yield task
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
    return run
