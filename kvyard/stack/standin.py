"""A stand-in worker: the worker's wire protocol with no model behind it.

Gateway tests and `kvyard bench epp` need many endpoints that answer in
microseconds and whose load can be dialled in, so that what is measured is
routing, not inference. It speaks what the EPP and clients rely on: OpenAI
chat/completions (streaming and not), `/health`, `/metrics` with vLLM names,
and `x-kvyard-endpoint` on every response. Each answer echoes the last user
message, so callers can match responses to requests.

`POST /standin/queue {"waiting": N}` sets the reported queue depth. The worker's
`--kv-*` flags give it a real kvstore (`standin_kv.py`): one small block per
request, its tiers' series on `/metrics`.
Run: `python -m kvyard.stack.standin --port P [--kv-dram-gb 1 ...]`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from kvyard.common import wire
from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.kvstore.flags import add_kv_arguments
from kvyard.stack.standin_kv import KV_HEADER, StandinKV


@dataclass(slots=True)
class StandinState:
    address: str
    model: str
    waiting: int = 0
    running: int = 0
    served: int = 0
    tokens: int = 4
    token_delay_s: float = 0.0


def _metrics(st: StandinState) -> bytes:
    kv = min(1.0, 0.01 * (st.running + st.waiting))
    lines = [
        f"# TYPE {wire.M_WAITING} gauge", f"{wire.M_WAITING} {st.waiting}",
        f"# TYPE {wire.M_RUNNING} gauge", f"{wire.M_RUNNING} {st.running}",
        f"# TYPE {wire.M_KV_USAGE} gauge", f"{wire.M_KV_USAGE} {kv}",
        f"# TYPE {wire.M_CACHE_CONFIG} gauge",
        f'{wire.M_CACHE_CONFIG}{{block_size="16",num_gpu_blocks="1024"}} 1',
        f"# TYPE {wire.M_PREFIX_QUERIES} counter", f"{wire.M_PREFIX_QUERIES} 0",
        f"# TYPE {wire.M_PREFIX_HITS} counter", f"{wire.M_PREFIX_HITS} 0",
    ]
    return ("\n".join(lines) + "\n").encode()


def _last_user_text(body: dict) -> str:
    if "messages" in body:
        for m in reversed(body["messages"]):
            if isinstance(m, dict) and m.get("role") == "user":
                c = m.get("content")
                return c if isinstance(c, str) else json.dumps(c)
        return ""
    p = body.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)


def _bad(msg: str, st: StandinState) -> web.Response:
    return web.json_response({"error": {"message": msg, "type": "invalid_request_error"}},
                             status=400, headers={wire.ENDPOINT_HEADER: st.address})


def make_app(st: StandinState, kv: StandinKV | None = None) -> web.Application:
    hdr = {wire.ENDPOINT_HEADER: st.address}
    registry = None
    if kv is not None:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        registry.register(kv.collector())

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok", headers=hdr)

    async def metrics(_: web.Request) -> web.Response:
        body = _metrics(st)
        if registry is not None:
            from prometheus_client import generate_latest

            body += generate_latest(registry)
        return web.Response(body=body, content_type="text/plain", headers=hdr)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": st.model, "object": "model"}]},
                                 headers=hdr)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"served": st.served, "waiting": st.waiting,
                                  "running": st.running}, headers=hdr)

    async def set_queue(req: web.Request) -> web.Response:
        st.waiting = int((await req.json())["waiting"])
        return web.json_response({"waiting": st.waiting}, headers=hdr)

    async def generate(req: web.Request) -> web.StreamResponse:
        chat = req.path.endswith("/chat/completions")
        try:
            body = json.loads(await req.read())
        except (ValueError, UnicodeDecodeError):
            return _bad("body is not JSON", st)
        if not isinstance(body, dict) or ("messages" if chat else "prompt") not in body:
            return _bad("missing messages" if chat else "missing prompt", st)
        st.running += 1
        st.served += 1
        try:
            text = f"[{st.address}] {_last_user_text(body)}"
            rid = f"standin-{st.served}"
            # Lets tests see routing headers as the worker received them.
            rh = {**hdr, "x-standin-prefiller": req.headers.get(wire.PREFILLER_HEADER, "-")}
            if kv is not None:
                rh[KV_HEADER] = await kv.atouch(_last_user_text(body))
            if body.get("stream"):
                return await _stream(req, st, rid, text, chat, rh)
            if st.token_delay_s:
                await asyncio.sleep(st.token_delay_s * st.tokens)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "stop"} if chat else
                      {"index": 0, "text": text, "finish_reason": "stop"})
            return web.json_response({
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": st.model, "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": st.tokens,
                          "total_tokens": 1 + st.tokens}}, headers=rh)
        finally:
            st.running -= 1

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/standin/queue", set_queue)
    app.router.add_get("/standin/stats", stats)
    return app


async def _stream(req: web.Request, st: StandinState, rid: str, text: str, chat: bool,
                  hdr: dict[str, str]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**hdr, "Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(req)
    obj = "chat.completion.chunk" if chat else "text_completion"
    pieces = [text] + [""] * max(0, st.tokens - 1)
    for i, piece in enumerate(pieces):
        if chat:
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": None}
        chunk = {"id": rid, "object": obj, "created": int(time.time()), "model": st.model,
                 "choices": [choice]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if st.token_delay_s:
            await asyncio.sleep(st.token_delay_s)
    end = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else \
        {"index": 0, "text": "", "finish_reason": "stop"}
    last = {"id": rid, "object": obj, "created": int(time.time()), "model": st.model,
            "choices": [end]}
    await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--advertise-address", default=None)
    p.add_argument("--model", default=DEMO_SERVED_NAME)
    p.add_argument("--role", default="both", help="reported in /health, as workers do")
    p.add_argument("--pd-key-file", default=None, help="accepted for the stack's sake; unused")
    p.add_argument("--waiting", type=int, default=0, help="initial reported queue depth")
    p.add_argument("--tokens", type=int, default=4, help="chunks per streamed answer")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between chunks")
    add_kv_arguments(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    st = StandinState(address=a.advertise_address or f"{a.host}:{a.port}", model=a.model,
                      waiting=a.waiting, tokens=a.tokens, token_delay_s=a.token_delay)
    kv = StandinKV(a)
    try:  # no --kv-* tier: no store, no per-request work (the routing benchmark's case)
        web.run_app(make_app(st, kv if kv.store is not None else None), host=a.host,
                    port=a.port, access_log=None, print=None, handle_signals=True)
    finally:
        kv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
