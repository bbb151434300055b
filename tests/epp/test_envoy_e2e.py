"""The EPP behind a real Envoy (the gateway's own bootstrap): proves the
pinned protocol — headers SEND, body STREAMED behind the buffer filter
(whole body in one chunk), routing answered on the headers message once the
body is in — end to end."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time

import aiohttp
import pytest

from kvyard.gateway.config import GatewayConfig
from kvyard.gateway.envoy import EnvoyNotFound, envoy_binary, envoy_command, write_config


@pytest.fixture
async def envoy(free_port, tmp_path):
    try:
        envoy_binary()
    except EnvoyNotFound as e:
        pytest.skip(str(e))
    procs = []

    async def start(ext_proc_port: int) -> int:
        port, admin = free_port(), free_port()
        cfg = GatewayConfig(listen_port=port, epp_address=f"127.0.0.1:{ext_proc_port}",
                            admin_port=admin)
        path = write_config(cfg, tmp_path / "envoy.yaml")
        procs.append(subprocess.Popen(envoy_command(path),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return port, admin

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


async def test_requests_reach_the_picked_worker_through_envoy(fake_vllm, epp, envoy, xp):
    w1, w2 = await fake_vllm(), await fake_vllm()
    app = await epp([w1, w2])
    port, admin = await envoy(app.ports["ext_proc"])
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        async def envoy_ready() -> bool:
            try:
                async with s.get(f"http://127.0.0.1:{admin}/ready") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False
        deadline = time.monotonic() + 30  # Envoy starts slowly on a busy machine
        while not await envoy_ready():
            assert time.monotonic() < deadline, "envoy never became ready"
            await asyncio.sleep(0.05)  # the readiness probe's poll period
        await xp.wait_for(app.is_ready, what="EPP ready")

        forged = {"x-gateway-destination-endpoint": "6.6.6.6:80",
                  "x-prefiller-host-port": "6.6.6.6:81"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi " * 50_000}]}
        async with s.post(base + "/v1/chat/completions", json=chat, headers=forged) as r:
            assert r.status == 200
            got = await r.json()
        assert got["served_by"] in (w1.address, w2.address)
        assert got["headers"]["x-gateway-destination-endpoint"] == got["served_by"]
        assert "x-prefiller-host-port" not in got["headers"]
        assert got["body_bytes"] == len(json.dumps(chat))

        async with s.get(base + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["served_by"] in (w1.address, w2.address)
        async with s.post(base + "/v1/chat/completions", data=b"{nope",
                          headers={"content-type": "application/json"}) as r:
            assert r.status == 400
            assert "not valid JSON" in (await r.json())["error"]["message"]
        bad_model = {"model": "other", "messages": [{"role": "user", "content": "x"}]}
        async with s.post(base + "/v1/chat/completions", json=bad_model) as r:
            assert r.status == 404
