"""Real servers for EPP tests: vLLM-format /metrics endpoints and a running EPP."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
import types
from typing import Callable

import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.pool.endpoints import EndpointSpec


@dataclass(slots=True)
class FakeVllm:
    """An HTTP server exporting vLLM gauges whose values the test sets."""

    port: int
    waiting: float = 0.0
    running: float = 0.0
    kv: float = 0.0
    sleeping: float | None = None  # exported as kvyard:sleeping when set (sleep mode)
    scrapes: int = 0
    _runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        text = (
            "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}\n'
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {self.kv}\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1.0\n'
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 3.0\n'
        )
        if self.sleeping is not None:
            text += f'kvyard:sleeping{{model_name="m"}} {self.sleeping}\n'
        return web.Response(text=text, content_type="text/plain")

    async def _echo(self, req: web.Request) -> web.Response:
        """Stands in for the OpenAI API: says who served it and what arrived."""
        body = await req.read()
        return web.json_response({"served_by": self.address, "body_bytes": len(body),
                                  "headers": {k.lower(): v for k, v in req.headers.items()}})

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._echo)
        app.router.add_post("/v1/completions", self._echo)
        app.router.add_get("/v1/models", self._echo)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def wait_for(pred: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> float:
    """Polls `pred` on the event loop until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture
async def fake_vllm(free_port):
    started: list[FakeVllm] = []

    async def make(**kw) -> FakeVllm:
        f = FakeVllm(free_port(), **kw)
        await f.start()
        started.append(f)
        return f

    yield make
    for f in started:
        await f.stop()


@pytest.fixture
async def metrics_site(free_port):
    """A loopback server whose GET /metrics is the test's handler; returns its address."""
    runners: list[web.AppRunner] = []

    async def make(handler: Callable[[web.Request], object]) -> str:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return f"127.0.0.1:{port}"

    yield make
    for r in runners:
        await r.cleanup()


@pytest.fixture
async def epp(free_port):
    apps: list[EppApp] = []

    async def make(endpoints: list[FakeVllm] | list[EndpointSpec] = (), **kw) -> EppApp:
        specs = [e if isinstance(e, EndpointSpec) else EndpointSpec(e.address) for e in endpoints]
        kw.setdefault("model", "none")
        kw.setdefault("served_model_names", ["m"])
        cfg = EppConfig(host="127.0.0.1", ext_proc_port=free_port(), health_port=free_port(),
                        metrics_port=free_port(), endpoints=specs, **kw)
        app = EppApp(cfg)
        await app.start()
        apps.append(app)
        return app

    yield make
    for a in apps:
        await a.stop()


# --- a real grpc.aio ext_proc client that speaks to the EPP as Envoy would ---


def headers_msg(headers: dict[str, str], end_of_stream: bool = False) -> ep.ProcessingRequest:
    hs = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=hs), end_of_stream=end_of_stream))


def body_msg(body: bytes, end_of_stream: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


async def exchange(port: int, msgs: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    """Sends `msgs` on one stream and collects every response until the EPP closes it
    or has answered each message."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ep_grpc.ExternalProcessorStub(ch).Process()
        for m in msgs:
            await call.write(m)
        await call.done_writing()
        out = []
        async for r in call:
            out.append(r)
        return out


def chat_headers(**extra: str) -> dict[str, str]:
    return {":method": "POST", ":path": "/v1/chat/completions",
            "content-type": "application/json", **extra}


def set_headers(resp: ep.ProcessingResponse) -> dict[str, str]:
    mut = resp.request_headers.response.header_mutation
    return {h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
            for h in mut.set_headers}


@pytest.fixture
def xp():
    """The ext_proc client helpers, as a namespace (test modules cannot import conftest)."""
    return types.SimpleNamespace(headers_msg=headers_msg, body_msg=body_msg, exchange=exchange,
                                 chat_headers=chat_headers, set_headers=set_headers,
                                 wait_for=wait_for)
