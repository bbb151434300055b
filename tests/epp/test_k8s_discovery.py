"""Pod discovery through the real `kubernetes` client against a small real
HTTP server that speaks the two API calls it makes (list, then watch)."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from kvyard.epp.pool.discovery_k8s import K8sDiscovery
from kvyard.epp.pool.endpoints import EndpointPool


def _pod(name: str, ip: str, ready: bool, role: str | None = None) -> dict:
    labels = {"app": "kvyard"} | ({"kvyard.io/role": role} if role else {})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class FakeApi:
    """GET /api/v1/namespaces/ns/pods: a PodList, or with watch=true a stream of events."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.events: asyncio.Queue = asyncio.Queue()
        self.selectors: list[str] = []
        self.runner: web.AppRunner | None = None

    async def pods_handler(self, req: web.Request) -> web.StreamResponse:
        self.selectors.append(req.query.get("labelSelector", ""))
        if req.query.get("watch") not in ("true", "True", "1"):
            return web.json_response({"apiVersion": "v1", "kind": "PodList",
                                      "metadata": {"resourceVersion": "1"}, "items": self.pods})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(req)
        while True:
            ev = await self.events.get()
            await resp.write((json.dumps(ev) + "\n").encode())

    async def start(self, port: int) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ns/pods", self.pods_handler)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()


async def test_ready_pods_join_and_leave_live(free_port, xp):
    api = FakeApi([_pod("a", "10.0.0.1", True, "decode"), _pod("b", "10.0.0.2", False)])
    port = free_port()
    await api.start(port)
    pool = EndpointPool()
    disc = K8sDiscovery("ns", "app=kvyard", 8000, pool, asyncio.get_running_loop(),
                        api_host=f"http://127.0.0.1:{port}")
    disc.start()
    try:
        def addrs():
            return {e.address: e.role for e in pool.all()}
        await xp.wait_for(lambda: addrs() == {"10.0.0.1:8000": "decode"}, what="initial list")
        assert api.selectors[0] == "app=kvyard"
        await api.events.put({"type": "MODIFIED", "object": _pod("b", "10.0.0.2", True)})
        await xp.wait_for(lambda: addrs() == {"10.0.0.1:8000": "decode", "10.0.0.2:8000": "both"},
                          what="pod b became ready")
        await api.events.put({"type": "MODIFIED", "object": _pod("a", "10.0.0.1", False)})
        await xp.wait_for(lambda: addrs() == {"10.0.0.2:8000": "both"}, what="pod a unready")
        await api.events.put({"type": "DELETED", "object": _pod("b", "10.0.0.2", True)})
        await xp.wait_for(lambda: addrs() == {}, what="pod b deleted")
    finally:
        disc.stop()
        await api.runner.cleanup()
