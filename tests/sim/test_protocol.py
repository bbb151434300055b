"""A simulated pod speaks the worker's protocol: OpenAI completions and chat, streamed or
not, with usage; /metrics the EPP's parser reads; the probes peers send."""
from __future__ import annotations

import json
import subprocess
import sys

import aiohttp

from kvyard.epp.pool.metrics_parse import parse_vllm_metrics


async def _sse(resp: aiohttp.ClientResponse) -> list:
    out = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


async def test_completions_and_chat_with_usage(start_pods, tok) -> None:
    async with start_pods(1) as g, aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        prompt = "The simulator tokenizes prompts as the worker does."
        async with s.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 7}) as r:
            assert r.status == 200
            assert r.headers["x-kvyard-endpoint"] == g.pods[0].address
            doc = await r.json()
        assert doc["object"] == "text_completion"
        assert doc["choices"][0]["finish_reason"] == "length"
        assert doc["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=True))
        assert doc["usage"]["completion_tokens"] == 7
        assert doc["usage"]["total_tokens"] == doc["usage"]["prompt_tokens"] + 7
        assert doc["choices"][0]["text"]

        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        async with s.post(base + "/v1/chat/completions",
                          json={"model": tok.name, "messages": msgs, "max_tokens": 3}) as r:
            doc = await r.json()
        assert doc["object"] == "chat.completion"
        assert doc["choices"][0]["message"]["role"] == "assistant"
        assert doc["usage"]["prompt_tokens"] == len(tok.encode_chat(msgs))
        assert doc["usage"]["completion_tokens"] == 3

        async with s.post(base + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                                            "model": "no-such-model"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        async with s.post(base + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400


async def test_streaming_chat_and_completions(start_pods, tok) -> None:
    async with start_pods(1) as g, aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        body = {"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(base + "/v1/chat/completions", json=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await _sse(r)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"])
        assert text
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI's explicit null

        async with s.post(base + "/v1/completions",
                          json={"prompt": "no usage", "max_tokens": 4, "stream": True}) as r:
            events = await _sse(r)
        assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
        assert sum(1 for e in events[:-1] if e["choices"][0]["text"]) >= 1


async def test_metrics_parse_with_the_epps_parser(start_pods) -> None:
    async with start_pods(1, kv_cache_size=777) as g, aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        async with s.post(base + "/v1/completions", json={"prompt": "count me", "max_tokens": 3}):
            pass
        async with s.get(base + "/metrics") as r:
            text = await r.text()
    m = parse_vllm_metrics(text)
    assert m.seen >= 8
    assert (m.block_size, m.num_gpu_blocks) == (16, 777)
    assert m.waiting == 0 and m.running == 0 and m.kv_usage == 0.0
    assert m.generation_tokens == 3 and m.finished == 1 and m.prompt_tokens > 0
    assert m.prompt_tokens_pending == 0


async def test_the_probes_peers_send(start_pods) -> None:
    async with start_pods(1) as g, aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}"
        for path in ("/health", "/v1/models", "/get_model_info", "/get_server_info", "/get_load",
                     "/server_info", "/get_loads", "/version"):
            async with s.get(base + path) as r:
                assert r.status == 200, path
                doc = await r.json()
            if path == "/v1/models":
                assert doc["data"][0]["id"]
            if path == "/get_server_info":
                assert doc["page_size"] == 16 and doc["max_running_requests"] > 0
            if path == "/get_load":
                assert doc[0]["num_reqs"] == 0
        for path in ("/ping", "/health_generate"):
            async with s.get(base + path) as r:
                assert r.status == 200, path
        async with s.post(base + "/v1/completions", json={"prompt": "x " * 40, "max_tokens": 1}):
            pass
        assert g.pods[0].engine.pool.lru
        async with s.post(base + "/flush_cache") as r:
            assert r.status == 200
        assert not g.pods[0].engine.pool.lru


def test_the_simulator_imports_no_torch_and_no_worker() -> None:
    code = ("import sys, kvyard.sim.pool, kvyard.sim.cli, kvyard.sim.calibrate, "
            "kvyard.stack.sim_pool; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('kvyard.workers')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
