"""What the gateway exposes, through the real Envoy and a real EPP: the OpenAI API, the
tokenizer routes and a minimal health answer. A worker's internals (/metrics, its /health
with the P/D peer endpoint, sleep, version) are 404 at the gateway, in OpenAI's error shape,
and never reach the EPP or a worker."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time

import aiohttp
import pytest
from aiohttp import web

from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.gateway.config import API_PATHS, GatewayConfig
from kvyard.gateway.envoy import EnvoyNotFound, envoy_binary, envoy_command, write_config

_GAUGES = ('vllm:num_requests_waiting{model_name="m"} 0\n'
           'vllm:num_requests_running{model_name="m"} 0\n'
           'vllm:kv_cache_usage_perc{model_name="m"} 0\n')
_SECRET = "kv-peer 10.9.9.9:8001"


class _Worker:
    """Answers every path with who served it; /metrics and /health carry internals."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.runner: web.AppRunner | None = None

    async def _any(self, req: web.Request) -> web.Response:
        self.hits.append(req.path)
        if req.path == "/metrics":
            return web.Response(text=_GAUGES + "# " + _SECRET + "\n", content_type="text/plain")
        return web.json_response({"served": req.path, "peer": _SECRET})

    async def start(self, port: int) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"127.0.0.1:{port}"


@pytest.fixture
async def stack(free_port, tmp_path):
    try:
        envoy_binary()
    except EnvoyNotFound as e:
        pytest.skip(str(e))
    worker = _Worker()
    address = await worker.start(free_port())
    epp = EppApp(EppConfig(host="127.0.0.1", ext_proc_port=free_port(), health_port=free_port(),
                           metrics_port=free_port(), endpoints=[EndpointSpec(address)],
                           model="none", served_model_names=["m"], scrape_interval=0.05))
    await epp.start()
    port, admin = free_port(), free_port()
    cfg = GatewayConfig(listen_port=port, admin_port=admin,
                        epp_address=f"127.0.0.1:{epp.cfg.ext_proc_port}")
    proc = subprocess.Popen(envoy_command(write_config(cfg, tmp_path / "envoy.yaml")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 30  # Envoy starts slowly on a busy machine
            while True:
                try:
                    async with s.get(f"http://127.0.0.1:{admin}/ready") as r:
                        if r.status == 200 and epp.is_ready():
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "gateway or EPP never became ready"
                await asyncio.sleep(0.05)  # the readiness probe's poll period
            yield s, f"http://127.0.0.1:{port}", worker
    finally:
        proc.terminate()
        proc.wait(10)
        await epp.stop()
        await worker.runner.cleanup()


async def test_the_api_goes_through_and_the_internals_do_not(stack):
    s, base, worker = stack
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"model": "m", "prompt": "hi"}),
                       ("/tokenize", {"model": "m", "prompt": "hi"})):
        async with s.post(base + path, json=body) as r:
            assert r.status == 200, (path, await r.text())
            assert (await r.json())["served"] == path
    # /detokenize passes the gateway to the EPP (whose body checks answer it)
    async with s.post(base + "/detokenize", json={"model": "m", "tokens": [1, 2]}) as r:
        assert (await r.json()).get("error", {}).get("code") != "not_found"
    async with s.get(base + "/v1/models?limit=1") as r:
        assert r.status == 200 and (await r.json())["served"] == "/v1/models"
    assert set(worker.hits) >= set(API_PATHS) - {"/detokenize"}

    # (the EPP scrapes /metrics itself, so that path is left out of the comparison)
    before = [h for h in worker.hits if h != "/metrics"]
    for method, path in (("GET", "/metrics"), ("GET", "/version"), ("POST", "/sleep"),
                         ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("GET", "/"),
                         ("POST", "/v1/load_lora_adapter"), ("GET", "/v1/models/../metrics"),
                         ("GET", "/v1/modelsx"), ("GET", "/metrics?x=/v1/models")):
        async with s.request(method, base + path, json=chat if method == "POST" else None) as r:
            raw = await r.read()
            assert r.status == 404, (method, path, raw)
            assert r.content_type == "application/json"
            err = json.loads(raw)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "not_found" and "/v1/chat/completions" in err["message"]
            assert b"vllm:" not in raw and _SECRET.encode() not in raw
    # /health: the gateway's own answer, none of a worker's
    async with s.get(base + "/health") as r:
        raw = await r.read()
        assert r.status == 200 and _SECRET.encode() not in raw
    assert [h for h in worker.hits if h != "/metrics"] == before  # none reached a worker
