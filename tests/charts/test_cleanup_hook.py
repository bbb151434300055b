"""The chart's pre-delete Job, run for real: its script (as rendered, with the kubernetes
client it runs with in the image) against the operator's test API (kmock's emulator with
finalizers and garbage collection), with the real operator running, and without one."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import helm_python as helm

pytest.importorskip("kmock")
testing = pytest.importorskip("kvyard.operator.testing")

import kmock  # noqa: E402

from kvyard.operator.handlers import OperatorConfig, run_operator  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvyard"
NS = "default"


def _rendered(values: dict[str, Any]) -> list[dict[str, Any]]:
    out = helm.Chart.load(str(CHART)).render(values, name="kvyard", namespace=NS)
    return [d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _hook_and_service() -> tuple[dict, dict]:
    values = copy.deepcopy(yaml.safe_load((CHART / "values-cpu.yaml").read_text()))
    values["redis"] = {"enabled": False}  # no Redis in the emulator: nothing to probe
    objs = _rendered(values)
    [job] = [o for o in objs if o["kind"] == "Job"]
    [svc] = [o for o in objs if o["kind"] == "InferenceService"]
    return job, svc


async def _run_hook(job: dict, url: str, tmp_path: Path, timeout_s: str | None = None
                    ) -> tuple[int, str]:
    [c] = job["spec"]["template"]["spec"]["containers"]
    script = c["args"][0]
    assert "config.load_incluster_config()" in script
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "t", "user": {}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    script = script.replace("config.load_incluster_config()",
                            f"config.load_kube_config(config_file={str(kubeconfig)!r})")
    env = {e["name"]: e["value"] for e in c["env"]}
    if timeout_s is not None:
        env["TIMEOUT_S"] = timeout_s
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=str(tmp_path))
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode()


async def _until(pred, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise TimeoutError(what)


@contextlib.asynccontextmanager
async def _api():
    async with testing.ApiServer().declare() as handler, kmock.Server(handler):
        yield handler


async def _create(api, svc: dict, finalizers: list[str] | None = None) -> None:
    import aiohttp

    body = {k: v for k, v in svc.items()}
    body["metadata"] = {"name": svc["metadata"]["name"], "namespace": NS,
                        **({"finalizers": finalizers} if finalizers else {})}
    async with aiohttp.ClientSession() as s:
        url = f"{str(api.url).rstrip('/')}/apis/kvyard.io/v1alpha1/namespaces/{NS}/inferenceservices"
        async with s.post(url, json=body) as r:
            assert r.status < 300, await r.text()


def _children(api, service: str) -> list[dict]:
    return [o for o in api.live()
            if (o["metadata"].get("labels") or {}).get("kvyard.io/service") == service
            and o["kind"] != "InferenceService"]


async def test_hook_deletes_the_service_while_the_operator_runs(tmp_path, monkeypatch):
    """kopf holds a finalizer for the operator's resync timer; when the deletion arrives
    while the timer runs a pass, kopf polls again only after
    settings.background.cancellation_polling (60 s by default: a release then takes up to
    a minute, well inside the hook's 120 s). Polled every 0.2 s here, so the test is fast."""
    from kvyard.operator import handlers

    configure = handlers.configure

    def quick(settings, cfg):
        configure(settings, cfg)
        settings.background.cancellation_polling = 0.2

    monkeypatch.setattr(handlers, "configure", quick)
    job, svc = _hook_and_service()
    name = svc["metadata"]["name"]
    async with _api() as api:
        stop = asyncio.Event()
        cfg = OperatorConfig(resync_s=0.5, retry_s=0.2, server=str(api.url))
        task = asyncio.create_task(run_operator(cfg, [NS], clusterwide=False, stop_flag=stop))
        try:
            await _create(api, svc)
            await _until(lambda: _children(api, name), what="the operator's children")
            await api.settle()  # the Deployment controller's part: rolled out
            cr = await _until(lambda: (api.get_live("inferenceservices", NS, name) or {})
                              .get("metadata", {}).get("finalizers"), what="kopf's finalizer")
            assert cr
            rc, out = await _run_hook(job, str(api.url), tmp_path, timeout_s="30")
            assert rc == 0, out
            assert f"InferenceService {NS}/{name} deleted" in out
            assert "removing its finalizer" not in out, out  # the operator released it
            assert api.get_live("inferenceservices", NS, name) is None
            await _until(lambda: not _children(api, name), what="children collected")
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)


async def test_hook_removes_the_finalizer_when_no_operator_answers(tmp_path):
    job, svc = _hook_and_service()
    name = svc["metadata"]["name"]
    async with _api() as api:
        await _create(api, svc, finalizers=["kvyard.io/operator"])
        rc, out = await _run_hook(job, str(api.url), tmp_path, timeout_s="1")
        assert rc == 0, out
        assert "removing its finalizer" in out and "deleted" in out
        assert api.get_live("inferenceservices", NS, name) is None


async def test_hook_is_a_no_op_when_the_service_is_gone(tmp_path):
    job, _ = _hook_and_service()
    async with _api() as api:
        rc, out = await _run_hook(job, str(api.url), tmp_path)
        assert rc == 0, out


async def test_hook_deletes_every_service_the_operator_watched(tmp_path):
    """Not only the chart's: one a user created elsewhere is deleted too, both named."""
    job, svc = _hook_and_service()
    mine = copy.deepcopy(svc)
    mine["metadata"]["name"] = "users-own"
    async with _api() as api:
        await _create(api, svc, finalizers=["kvyard.io/operator"])
        await _create(api, mine, finalizers=["kvyard.io/operator"])
        rc, out = await _run_hook(job, str(api.url), tmp_path, timeout_s="1")
        assert rc == 0, out
        for name in (svc["metadata"]["name"], "users-own"):
            assert f"InferenceService {NS}/{name} deleted" in out
            assert api.get_live("inferenceservices", NS, name) is None


async def test_hook_fails_naming_what_it_could_not_delete(tmp_path):
    """An API that accepts the deletes and patches but keeps the object (another controller's
    finalizer, an admission webhook): the Job fails, bounded, naming what is left."""
    from aiohttp import web

    job, svc = _hook_and_service()
    item = {**svc, "metadata": {"name": "stuck", "namespace": "team-x",
                                "finalizers": ["other.example/keep"]}}
    seen = []

    async def handle(req: web.Request) -> web.Response:
        seen.append(req.method)
        if req.method == "GET":
            return web.json_response({"apiVersion": "kvyard.io/v1alpha1",
                                      "kind": "InferenceServiceList", "items": [item]})
        return web.json_response(item)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        c = job["spec"]["template"]["spec"]["containers"][0]
        c["env"] = [*c["env"], {"name": "GRACE_S", "value": "0.5"}]
        t0 = time.monotonic()
        rc, out = await _run_hook(job, f"http://127.0.0.1:{port}", tmp_path, timeout_s="0.5")
        assert rc != 0, out
        assert "still present after deletion: team-x/stuck" in out, out
        assert "team-x/stuck: the operator did not finish; removing its finalizer" in out
        assert time.monotonic() - t0 < 30  # bounded
        assert {"DELETE", "PATCH"} <= set(seen)
    finally:
        await runner.cleanup()
