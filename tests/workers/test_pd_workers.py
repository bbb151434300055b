"""P/D between two real workers on the demo model: the handoff's output equals the
colocated output, forged prefill targets are never contacted, damaged or dead
prefills fall back to the same output, and unpulled holds are freed.

Failures are made by `PDProxy`, a man in the middle in this process: its HTTP
side forwards the prefill leg to the real prefill worker and rewrites the
answer's `remote_port` to its own TCP side, which relays the peer transfer and
damages it on purpose: "corrupt" flips a byte of the first block's payload,
"truncate" closes after the first block, "pause" relays the first block and
waits for the test (which kills the prefill worker meanwhile), "hang" never
answers the prefill leg, "dead_peer" answers once the test says the blocks are
in the shared store, with a port that refuses connections.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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
            if self.mode == "dead_peer":  # the blocks' holder is gone once they are stored
                await asyncio.get_running_loop().run_in_executor(None, self.before_answer)
                ktp["remote_port"] = self.closed_port
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


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("pd") / "pd.key"
    p.write_text(secrets.token_hex(32))
    p.chmod(0o600)
    return p


def _env(key_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    env[pd_auth.KEY_ENV] = str(key_file)
    return env


@pytest.fixture(scope="module")
def prefill(tmp_path_factory, key_file, demo_gguf) -> Iterator[WorkerProcess]:
    w = start_worker([*WORKER_ARGS, "--role", "prefill", "--kv-hold-timeout", "5"],
                     tmp_path_factory.mktemp("pw") / "prefill.log", env=_env(key_file))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def decode(tmp_path_factory, key_file, demo_gguf) -> Iterator[WorkerProcess]:
    w = start_worker([*WORKER_ARGS, "--role", "decode", "--pd-prefill-timeout", "15"],
                     tmp_path_factory.mktemp("dw") / "decode.log", env=_env(key_file))
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


def test_roles_are_published(prefill, decode) -> None:
    for w, role in ((prefill, "prefill"), (decode, "decode")):
        with urllib.request.urlopen(w.base_url + "/health", timeout=10) as r:
            assert json.loads(r.read())["role"] == role
        assert scrape(w.base_url)[f'{wire.M_WORKER_INFO}{{role="{role}"}}'] == 1.0


def test_handoff_gives_the_colocated_output(prefill, decode, key_file, wait_until) -> None:
    want = reference(prefill, "Which river flows through Paris?")
    before = scrape(decode.base_url)
    status, got = post(decode.base_url, body("Which river flows through Paris?"),
                       signed(key_file, prefill_address(prefill)))
    assert status == 200, got
    assert text_of(got) == text_of(want)
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    after = scrape(decode.base_url)
    peer = f'{wire.M_PD_HANDOFFS}{{path="peer"}}'
    assert after[peer] == before[peer] + 1
    blocks = (want["usage"]["prompt_tokens"] - 1) // 16
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
    assert after[wire.M_PD_HANDOFF_BYTES] > before[wire.M_PD_HANDOFF_BYTES]
    # the prefill worker gave its held blocks back once they were pulled
    wait_until(lambda: kv_usage(prefill) == 0.0, timeout=60, what="held blocks freed")


def test_streamed_handoff_streams(prefill, decode, key_file) -> None:
    want = text_of(reference(prefill, "Name a mountain in the Alps."))
    req = urllib.request.Request(
        decode.base_url + "/v1/chat/completions",
        json.dumps(body("Name a mountain in the Alps.", stream=True)).encode(),
        {"Content-Type": "application/json", **signed(key_file, prefill_address(prefill))})
    parts = []
    with urllib.request.urlopen(req, timeout=180) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0]["delta"].get("content"):
                    parts.append(ch[0]["delta"]["content"])
    assert len(parts) >= 2 and "".join(parts) == want


def prefill_address(w: WorkerProcess) -> str:
    return f"127.0.0.1:{w.port}"


def test_forged_targets_are_never_contacted(decode, prefill, key_file) -> None:
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    target = f"127.0.0.1:{trap.getsockname()[1]}"
    other_key = pd_auth.sign(secrets.token_bytes(32), target)
    forged = [{wire.PREFILLER_HEADER: target},
              {wire.PREFILLER_HEADER: target, wire.PREFILLER_AUTH_HEADER: "9999999999.00ff"},
              {wire.PREFILLER_HEADER: target, wire.PREFILLER_AUTH_HEADER: other_key},
              # a real signature, for another target
              {wire.PREFILLER_HEADER: target,
               wire.PREFILLER_AUTH_HEADER: signed(key_file, prefill_address(prefill))[
                   wire.PREFILLER_AUTH_HEADER]},
              {wire.PREFILLER_HEADER: target,
               wire.PREFILLER_AUTH_HEADER: pd_auth.sign(pd_auth.load_key(key_file), target,
                                                        now=time.time() - 3600)}]
    before = scrape(decode.base_url)[wire.M_PD_REJECTED]
    try:
        for headers in forged:
            status, doc = post(decode.base_url, body("Is this a trap?"), headers)
            assert status == 403, doc
            assert doc["error"]["code"] == "prefill_target_refused"
            assert doc["error"]["type"] == "permission_error"
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody ever connected
    finally:
        trap.close()
    assert scrape(decode.base_url)[wire.M_PD_REJECTED] == before + len(forged)


@pytest.mark.parametrize("mode,reason", [("corrupt", "transfer_corrupt"),
                                         ("truncate", "transfer_truncated"),
                                         ("hang", "prefill_timeout")])
def test_damaged_handoffs_fall_back_to_the_same_output(prefill, decode, key_file, mode,
                                                       reason) -> None:
    user = f"Tell me about Lyon ({mode})."
    want = reference(prefill, user)
    proxy = PDProxy(prefill_address(prefill), mode).start()
    try:
        before = fallbacks(decode, reason)
        status, got = post(decode.base_url, body(user), signed(key_file, proxy.address))
        assert status == 200, got
        assert text_of(got) == text_of(want)
        assert proxy.legs == 1 and proxy.transfers == (0 if mode == "hang" else 1)
        assert fallbacks(decode, reason) == before + 1
    finally:
        proxy.stop()


def test_prefill_worker_killed_during_and_between_transfers(tmp_path, key_file, decode,
                                                             prefill) -> None:
    doomed = start_worker([*WORKER_ARGS, "--role", "prefill"], tmp_path / "doomed.log",
                          env=_env(key_file))
    proxy = PDProxy(prefill_address(doomed), "pause").start()
    user = "Describe the Loire valley."
    want = reference(prefill, user)
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, decode.base_url, body(user), signed(key_file, proxy.address))
            assert proxy.paused.wait(180), "the transfer never started"
            doomed.proc.kill()
            doomed.proc.wait(30)
            proxy.resume.set()
            status, got = fut.result(timeout=180)
        assert status == 200, got
        assert text_of(got) == text_of(want)
        # between requests: the prefill worker is gone, its address refuses connections
        before = fallbacks(decode, "prefill_unreachable")
        user2 = "Describe the Rhone valley."
        status, got = post(decode.base_url, body(user2), signed(key_file, prefill_address(doomed)))
        assert status == 200, got
        assert text_of(got) == text_of(reference(prefill, user2))
        assert fallbacks(decode, "prefill_unreachable") == before + 1
    finally:
        proxy.stop()
        if doomed.proc.poll() is None:
            doomed.proc.kill()


def test_unpulled_blocks_are_freed_after_the_hold_timeout(prefill, wait_until) -> None:
    leg = body("Count the bridges of Paris.")
    leg.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, doc = post(prefill.base_url, leg)
    assert status == 200, doc
    ktp = doc["kv_transfer_params"]
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    assert ktp["remote_block_ids"] and ktp["tp_size"] == 1
    assert {"remote_engine_id", "remote_request_id", "remote_host", "remote_port"} <= set(ktp)
    assert len(ktp["kvyard"]["block_hashes"]) == len(ktp["remote_block_ids"])
    assert kv_usage(prefill) > 0.0            # held for a pull that never comes
    wait_until(lambda: kv_usage(prefill) == 0.0, timeout=120, what="the hold's timeout")


def test_blocks_come_from_the_shared_store_when_the_peer_fails(tmp_path, key_file, wait_until
                                                               ) -> None:
    """Both workers on one pool tier (a shared SSD dir, as `kvyard up` gives them): a
    peer that cannot be reached costs the decode worker no prefill."""
    ssd = tmp_path / "kvcache"
    kv = ["--kv-dram-gb", "0.1", "--kv-ssd-dir", str(ssd), "--kv-ssd-gb", "1"]
    pw = start_worker([*WORKER_ARGS, *kv, "--role", "prefill"], tmp_path / "p.log",
                      env=_env(key_file))
    dw = start_worker([*WORKER_ARGS, *kv, "--role", "decode"], tmp_path / "d.log",
                      env=_env(key_file))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    proxy = PDProxy(prefill_address(pw), "dead_peer")
    proxy.closed_port = closed.getsockname()[1]
    closed.close()
    user = "What is the oldest bridge in Prague?"
    prompt_blocks = []

    def stored() -> None:
        wait_until(lambda: len(list(ssd.rglob("*.kvb"))) >= prompt_blocks[0], timeout=60,
                   what="the prefill worker's blocks on the shared SSD")
    proxy.before_answer = stored
    proxy.start()
    try:
        status, ref = post(pw.base_url, body(user))   # colocated answer (and the block count)
        assert status == 200, ref
        prompt_blocks.append((ref["usage"]["prompt_tokens"] - 1) // 16)
        for p in ssd.rglob("*.kvb"):                   # the store starts empty for the handoff
            p.unlink()
        restart = start_worker([*WORKER_ARGS, *kv, "--role", "prefill"], tmp_path / "p2.log",
                               env=_env(key_file))    # and so does the prefill worker's cache
        pw.stop()
        proxy.upstream = prefill_address(restart)
        before = scrape(dw.base_url)
        status, got = post(dw.base_url, body(user), signed(key_file, proxy.address))
        assert status == 200, got
        assert text_of(got) == text_of(ref)
        after = scrape(dw.base_url)
        store = f'{wire.M_PD_HANDOFFS}{{path="store"}}'
        assert after[store] == before[store] + 1
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_blocks[0] * 16
        restart.stop()
    finally:
        proxy.stop()
        dw.stop()
        if pw.proc.poll() is None:
            pw.stop()


def test_handoff_between_unlike_kv_layouts_is_refused(tmp_path, key_file, decode, prefill) -> None:
    """A bfloat16 prefill worker's blocks are not a float32 decode worker's: the offer's
    namespace differs, the decode worker pulls nothing and answers as it would alone."""
    args = [a if a != "float32" else "bfloat16" for a in WORKER_ARGS]
    other = start_worker([*args, "--role", "prefill"], tmp_path / "bf16.log", env=_env(key_file))
    try:
        user = "Which sea borders Marseille?"
        want = reference(prefill, user)
        before = fallbacks(decode, "kv_mismatch")
        peer = f'{wire.M_PD_HANDOFFS}{{path="peer"}}'
        loaded = scrape(decode.base_url)[peer]
        status, got = post(decode.base_url, body(user), signed(key_file, prefill_address(other)))
        assert status == 200, got
        assert text_of(got) == text_of(want)
        assert fallbacks(decode, "kv_mismatch") == before + 1
        assert scrape(decode.base_url)[peer] == loaded     # nothing was pulled
    finally:
        other.stop()
