"""The gateway reaching a TLS EPP (GatewayConfig.epp_tls_*): the rendered transport socket,
Envoy's own validation of it, and the real Envoy routing a chat request through the TLS
EPP (ext_proc and EDS both over TLS, mutual when the EPP asks) to a worker; a gateway that
does not trust the EPP's CA fails closed."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.gateway.config import EPP_CLUSTER, GatewayConfig, render
from kvyard.gateway.envoy import EnvoyNotFound, envoy_binary, envoy_command, write_config

_GAUGES = ('vllm:num_requests_waiting{model_name="m"} 0\n'
           'vllm:num_requests_running{model_name="m"} 0\n'
           'vllm:kv_cache_usage_perc{model_name="m"} 0\n')
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _epp_cluster(cfg: GatewayConfig) -> dict:
    return next(c for c in render(cfg)["static_resources"]["clusters"]
                if c["name"] == EPP_CLUSTER)


def test_plaintext_by_default_and_tls_when_given_a_ca() -> None:
    assert "transport_socket" not in _epp_cluster(GatewayConfig())
    cfg = GatewayConfig(epp_address="kv-epp.ns.svc:9002", epp_tls_ca_file="/tls/ca.crt")
    tls = _epp_cluster(cfg)["transport_socket"]["typed_config"]
    assert tls["sni"] == "kv-epp.ns.svc"
    common = tls["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    assert common["validation_context"]["trusted_ca"] == {"filename": "/tls/ca.crt"}
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "kv-epp.ns.svc"}}]
    assert "tls_certificates" not in common
    mtls = GatewayConfig(epp_address="10.0.0.1:9002", epp_tls_ca_file="/tls/ca.crt",
                         epp_tls_cert_file="/tls/tls.crt", epp_tls_key_file="/tls/tls.key")
    tls = _epp_cluster(mtls)["transport_socket"]["typed_config"]
    assert "sni" not in tls  # an IP is no SNI; it is checked as an IP SAN
    assert tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"][0][
        "san_type"] == "IP_ADDRESS"
    assert tls["common_tls_context"]["tls_certificates"] == [{
        "certificate_chain": {"filename": "/tls/tls.crt"},
        "private_key": {"filename": "/tls/tls.key"}}]


def test_envoy_accepts_the_tls_config(tmp_path, tls_certs) -> None:
    try:
        envoy_binary()
    except EnvoyNotFound as e:
        pytest.skip(str(e))
    cfg = GatewayConfig(listen_port=18080, admin_port=19901, epp_address="127.0.0.1:19002",
                        epp_tls_ca_file=str(tls_certs["ca"]), epp_tls_sni="localhost",
                        epp_tls_cert_file=str(tls_certs["client_cert"]),
                        epp_tls_key_file=str(tls_certs["client_key"]))
    conf = write_config(cfg, tmp_path / "envoy.yaml")
    r = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(conf), "-l", "error"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gateway_config_flags(capsys) -> None:
    from kvyard.cli import main

    assert main(["gateway-config", "--format", "json", "--epp", "kv-epp.ns.svc:9002",
                 "--epp-tls-ca", "/tls/ca.crt", "--epp-tls-cert", "/tls/tls.crt",
                 "--epp-tls-key", "/tls/tls.key"]) == 0
    out = capsys.readouterr().out
    assert '"sni": "kv-epp.ns.svc"' in out and '"/tls/tls.key"' in out
    with pytest.raises(SystemExit):
        main(["gateway-config", "--epp-tls-cert", "/tls/tls.crt", "--epp-tls-key", "k"])


async def _worker(port: int) -> web.AppRunner:
    async def any_path(req: web.Request) -> web.Response:
        if req.path == "/metrics":
            return web.Response(text=_GAUGES, content_type="text/plain")
        return web.json_response({"served": req.path})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.fixture
async def tls_stack(free_port, tmp_path, tls_certs, gateway_ready):
    """start(mutual, gateway_ca) -> (session, gateway URL, admin port, EPP)."""
    try:
        envoy_binary()
    except EnvoyNotFound as e:
        pytest.skip(str(e))
    wport = free_port()
    runner = await _worker(wport)
    started: list = []

    async def start(mutual: bool = False, gateway_ca: str = "ca"):
        epp = EppApp(EppConfig(
            host="127.0.0.1", ext_proc_port=free_port(), health_port=free_port(),
            metrics_port=free_port(), endpoints=[EndpointSpec(f"127.0.0.1:{wport}")],
            model="none", served_model_names=["m"], scrape_interval=0.05,
            tls_cert_file=str(tls_certs["server_cert"]), tls_key_file=str(tls_certs["server_key"]),
            tls_client_ca_file=str(tls_certs["ca"]) if mutual else None))
        await epp.start()
        started.append(epp)
        port, admin = free_port(), free_port()
        client = {"epp_tls_cert_file": str(tls_certs["client_cert"]),
                  "epp_tls_key_file": str(tls_certs["client_key"])} if mutual else {}
        cfg = GatewayConfig(listen_port=port, admin_port=admin,
                            epp_address=f"127.0.0.1:{epp.cfg.ext_proc_port}",
                            epp_tls_ca_file=str(tls_certs[gateway_ca]), epp_tls_sni="localhost",
                            **client)
        proc = subprocess.Popen(envoy_command(write_config(cfg, tmp_path / f"envoy{port}.yaml")),
                                stdout=subprocess.DEVNULL, stderr=sys.stderr)
        started.append(proc)
        s = aiohttp.ClientSession()
        started.append(s)
        await gateway_ready(s, admin, epp)
        return s, f"http://127.0.0.1:{port}", admin

    yield start
    for obj in reversed(started):
        if isinstance(obj, subprocess.Popen):
            obj.terminate()
            obj.wait(10)
        elif isinstance(obj, EppApp):
            await obj.stop()
        else:
            await obj.close()
    await runner.cleanup()


async def _chat_until_routed(s: aiohttp.ClientSession, base: str) -> None:
    """EDS (over the same TLS connection) may lag the listener by a moment: a request
    before the worker's host arrives gets 503, so poll until it routes."""
    deadline = time.monotonic() + 20
    while True:
        async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
            body = await r.text()
            if r.status == 200:
                assert '"served": "/v1/chat/completions"' in body.replace('":"', '": "')
                return
        assert time.monotonic() < deadline, (r.status, body)
        await asyncio.sleep(0.1)


async def test_envoy_routes_through_a_tls_epp(tls_stack):
    s, base, _ = await tls_stack()
    await _chat_until_routed(s, base)


async def test_envoy_routes_through_a_mutual_tls_epp(tls_stack):
    s, base, _ = await tls_stack(mutual=True)
    await _chat_until_routed(s, base)


async def test_a_gateway_that_does_not_trust_the_epp_fails_closed(tls_stack):
    s, base, _ = await tls_stack(gateway_ca="other_ca")
    async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "endpoint_picker_unavailable"
