"""Shared by the P/D tests between real workers on the demo model: the workers (one
prefill, one decode pulling through the same-host memfd, one decode pulling over TCP,
for the whole session; one that does not stream), the requests, the scrapes, and
`PDProxy`. Test modules cannot
import a conftest: they get the helpers through the `pdh` fixture.

Failures are made by `PDProxy`, a man in the middle in this process: its HTTP
side forwards the prefill leg to the real prefill worker and rewrites the
answer's `remote_port` to its own TCP side, which relays the peer transfer and
damages it on purpose: "corrupt" flips a byte of the first block's payload,
"truncate" closes after the first block, "pause" relays the first block and
waits for the test (which kills the prefill worker meanwhile), "hang" never
answers the prefill leg, "dead_peer" answers once the test says the blocks are
in the shared store, with a port that refuses connections. It relays TCP, so it
takes the offer's `shm` away: a decode worker on this host would otherwise pull
around it. It serves no /health, so decode workers pull from its offers, unless
made with `stream=True`: then its /health points streamed pulls at the relay too
(the same damage, to the first streamed block).
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import aiohttp
import pytest
from aiohttp import web

from kvyard.common import pd_auth, wire
from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.workers.server.testing import WorkerProcess, start_worker

_HEAD = 8  # peer_wire message header: magic + u32 length


@dataclass
class PDProxy:
    upstream: str                         # the real prefill worker, host:port
    mode: str = "pass"
    http_port: int = 0
    tcp_port: int = 0
    paused: threading.Event = field(default_factory=threading.Event)
    resume: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    legs: int = 0
    transfers: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _peer: tuple[str, int] | None = None
    before_answer: object = None          # "dead_peer": called before the leg answers
    stream: bool = False                  # also relay streamed pulls (its /health points here)
    closed_port: int = 0                  # "dead_peer": where the offer then points
    _runner: web.AppRunner | None = None
    _srv: asyncio.AbstractServer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def start(self) -> "PDProxy":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(30)
        return self

    def stop(self) -> None:
        self.done.set()
        self.resume.set()
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _shutdown(self) -> None:
        self._srv.close()
        await self._runner.cleanup()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._leg)
        if self.stream:
            app.router.add_get("/health", self._health)
        runner = self._runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]
        srv = self._srv = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.tcp_port = srv.sockets[0].getsockname()[1]

    async def _leg(self, request: web.Request) -> web.Response:
        self.legs += 1
        body = await request.read()
        if self.mode == "hang":
            await asyncio.get_running_loop().run_in_executor(None, self.done.wait)
            return web.Response(status=503)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{self.upstream}{request.path}", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                status, data = r.status, await r.read()
        doc = json.loads(data)
        ktp = doc.get("kv_transfer_params")
        if isinstance(ktp, dict) and ktp.get("remote_port"):
            self._peer = (ktp["remote_host"], ktp["remote_port"])
            ktp["remote_port"] = self.tcp_port
            ktp["kvyard"]["shm"] = False
            if self.mode == "dead_peer":  # the blocks' holder is gone once they are stored
                await asyncio.get_running_loop().run_in_executor(None, self.before_answer)
                ktp["remote_port"] = self.closed_port
        return web.json_response(doc, status=status)

    async def _health(self, request: web.Request) -> web.Response:
        """The prefill worker's /health, its peer endpoint replaced by this relay's."""
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{self.upstream}/health") as r:
                status, doc = r.status, await r.json()
        peer = doc.get("kv_peer")
        if peer:
            self._peer = (self.upstream.rpartition(":")[0], peer["port"])
            peer.update(port=self.tcp_port, shm=False)
        return web.json_response(doc, status=status)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.transfers += 1
        up_r, up_w = await asyncio.open_connection(*self._peer)
        try:
            req = await reader.readexactly(_HEAD)
            req += await reader.readexactly(int.from_bytes(req[4:8], "little"))
            up_w.write(req)
            await up_w.drain()
            head = await up_r.readexactly(_HEAD)
            head += await up_r.readexactly(int.from_bytes(head[4:8], "little"))
            writer.write(head)
            meta = json.loads(head[_HEAD:])
            frame = 80 + meta.get("block_bytes", 0)
            if meta.get("stream"):               # the first range's header comes first
                rng = await up_r.readexactly(_HEAD)
                rng += await up_r.readexactly(int.from_bytes(rng[4:8], "little"))
                writer.write(rng)
            first = bytearray(await up_r.readexactly(frame))
            if self.mode == "corrupt":
                first[80 + len(first) // 2] ^= 0xFF
            writer.write(bytes(first))
            await writer.drain()
            if self.mode == "truncate":
                return
            if self.mode == "pause":
                self.paused.set()
                await asyncio.get_running_loop().run_in_executor(None, self.resume.wait)
            while chunk := await up_r.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            up_w.close()


# ---------------------------------------------------------------- the workers
PROMPT_SYSTEM = ("You are a helpful assistant who answers questions about geography in "
                 "detail, with care, and briefly. ") * 10


def body(user: str, **kw) -> dict:
    return {"model": DEMO_SERVED_NAME, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "system", "content": PROMPT_SYSTEM},
                         {"role": "user", "content": user}], **kw}


def post(base: str, doc: dict, headers: dict | None = None,
         path: str = "/v1/chat/completions") -> tuple[int, dict]:
    req = urllib.request.Request(base + path, json.dumps(doc).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def text_of(doc: dict) -> str:
    return doc["choices"][0]["message"]["content"]


WORKER_ARGS = ["--model", "demo", "--dtype", "float32", "--max-model-len", "2048",
               "--kv-cache-memory-bytes", "128MiB", "--num-threads", "1"]


@pytest.fixture(scope="session")
def key_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("pd") / "pd.key"
    p.write_text(secrets.token_hex(32))
    p.chmod(0o600)
    return p


def _env(key_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    env[pd_auth.KEY_ENV] = str(key_file)
    return env


@pytest.fixture(scope="session")
def prefill(tmp_path_factory, key_file, demo_gguf) -> Iterator[WorkerProcess]:
    w = start_worker([*WORKER_ARGS, "--role", "prefill", "--kv-hold-timeout", "5"],
                     tmp_path_factory.mktemp("pw") / "prefill.log", env=_env(key_file))
    yield w
    w.stop()


@pytest.fixture(scope="session")
def prefill_chunked(tmp_path_factory, key_file, demo_gguf) -> Iterator[WorkerProcess]:
    """Prefills in 32-token chunks: a long prompt's blocks are published step by step."""
    w = start_worker([*WORKER_ARGS, "--role", "prefill", "--max-num-batched-tokens", "32"],
                     tmp_path_factory.mktemp("pwc") / "prefill-chunked.log", env=_env(key_file))
    yield w
    w.stop()


def _decode_worker(tmp_path_factory, key_file: Path, name: str, *extra: str) -> WorkerProcess:
    return start_worker([*WORKER_ARGS, "--role", "decode", *extra],
                        tmp_path_factory.mktemp(name) / f"{name}.log", env=_env(key_file))


@pytest.fixture(scope="session")
def decode(tmp_path_factory, key_file, demo_gguf) -> Iterator[WorkerProcess]:
    """Pulls through the same-host memfd where offered (the default transports)."""
    w = _decode_worker(tmp_path_factory, key_file, "decode", "--pd-prefill-timeout", "15")
    yield w
    w.stop()


@pytest.fixture(scope="session")
def decode_tcp(tmp_path_factory, key_file, demo_gguf) -> Iterator[WorkerProcess]:
    """Pulls over TCP only, as a decode worker on another host does."""
    w = _decode_worker(tmp_path_factory, key_file, "decode-tcp", "--pd-transports", "tcp")
    yield w
    w.stop()


@pytest.fixture(scope="session")
def decode_classic(tmp_path_factory, key_file, demo_gguf) -> Iterator[WorkerProcess]:
    """Pulls only once the prefill has answered, from its offer (no streaming)."""
    w = _decode_worker(tmp_path_factory, key_file, "decode-classic", "--no-pd-stream")
    yield w
    w.stop()


def signed(key_file: Path, target: str) -> dict[str, str]:
    key = pd_auth.load_key(key_file)
    return {wire.PREFILLER_HEADER: target,
            wire.PREFILLER_AUTH_HEADER: pd_auth.sign(key, target)}


def reference(prefill: WorkerProcess, user: str) -> dict:
    """The colocated answer: the prefill worker serving the request alone."""
    status, doc = post(prefill.base_url, body(user))
    assert status == 200, doc
    return doc


def fallbacks(decode: WorkerProcess, reason: str) -> float:
    return scrape(decode.base_url).get(f'{wire.M_PD_FALLBACKS}{{reason="{reason}"}}', 0.0)


def kv_usage(w: WorkerProcess) -> float:
    return next(v for k, v in scrape(w.base_url).items() if k.startswith(wire.M_KV_USAGE + "{"))


def prefill_address(w: WorkerProcess) -> str:
    return f"127.0.0.1:{w.port}"




def leg(prefill: WorkerProcess, user: str) -> dict:
    """A prefill leg sent by hand: the offer (kv_transfer_params) of the hold it leaves."""
    doc = body(user)
    doc.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, answer = post(prefill.base_url, doc)
    assert status == 200, answer
    return answer["kv_transfer_params"]


def counter(w: WorkerProcess, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return scrape(w.base_url).get(f"{name}{{{sel}}}" if sel else name, 0.0)


@pytest.fixture
def pdh():
    """The helpers above, for test modules (which cannot import conftest)."""
    import types

    return types.SimpleNamespace(
        PDProxy=PDProxy, WORKER_ARGS=WORKER_ARGS, body=body, post=post, scrape=scrape,
        text_of=text_of, env=_env, signed=signed, reference=reference, fallbacks=fallbacks,
        kv_usage=kv_usage, prefill_address=prefill_address, counter=counter, leg=leg,
        start_worker=start_worker)
