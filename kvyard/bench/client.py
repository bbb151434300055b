"""The one streaming OpenAI client of every `kvyard bench` that times tokens.

`stream` posts one streaming `/v1/completions` or `/v1/chat/completions` request
(the path follows the body: `messages` means chat) and times its chunks. The
definitions are vLLM's `bench serve`'s, so kvyard's numbers read like vLLM's:

- TTFT: from sending the request to the arrival of the first token-bearing chunk.
- ITL: the gap between each token-bearing chunk and the one before it; a chunk
  that carries several tokens is one gap, counted once.
- TPOT: (request latency - TTFT) / (output tokens - 1), per request (nan for one
  token); a bench's TPOT percentiles are over requests.
- Request latency: from sending the request to the end of its stream.
- Output tokens: `usage.completion_tokens` when the server reports it (the bodies
  built here ask for it), else the number of token-bearing chunks.

A token-bearing chunk has a choice with text: `text` (completions) or
`delta.content` (chat). A chat stream's role-only first chunk and a closing chunk
with only a finish reason carry none. Percentiles: `report.percentile`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp  # imported here, not per request: its import would land inside a timing


@dataclass(slots=True)
class RequestResult:
    ttft_s: float
    tpot_s: float                 # nan when the request had fewer than two output tokens
    num_tokens: int
    latency_s: float
    error: str | None = None
    index: int = -1               # position of the prompt in the caller's list
    text: str = ""                # the completion, to check systems did the same work
    itl_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


def _chunk_text(msg: dict[str, Any]) -> str:
    choices = msg.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


@dataclass(slots=True)
class StreamClock:
    """One stream's chunks as they arrive (`chunk`), then its metrics (`result`)."""

    sent: float
    first: float = math.nan
    last: float = math.nan
    chunks: int = 0
    usage_tokens: int | None = None
    error: str | None = None
    parts: list[str] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def chunk(self, now: float, msg: dict[str, Any]) -> None:
        text = _chunk_text(msg)
        if text:
            if self.chunks:
                self.itl.append(now - self.last)
            else:
                self.first = now
            self.last = now
            self.chunks += 1
            self.parts.append(text)
        usage = msg.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        if msg.get("error") and self.error is None:  # an error sent in the stream itself
            self.error = f"stream error: {json.dumps(msg['error'])[:300]}"

    def result(self, end: float, error: str | None = None) -> RequestResult:
        latency = end - self.sent
        error = error or self.error or (None if self.chunks else "no tokens streamed")
        if error is not None:
            return RequestResult(math.nan, math.nan, 0, latency, error)
        n = self.usage_tokens if self.usage_tokens is not None else self.chunks
        ttft = self.first - self.sent
        tpot = (latency - ttft) / (n - 1) if n > 1 else math.nan
        return RequestResult(ttft, tpot, n, latency, text="".join(self.parts), itl_s=self.itl)


def completion_body(model: str | None, prompt: str | Sequence[int], max_tokens: int,
                    ignore_eos: bool = True) -> dict[str, Any]:
    """vLLM's request for "exactly max_tokens greedy tokens" (`model` None: the server's one)."""
    body: dict[str, Any] = {} if model is None else {"model": model}
    body.update(prompt=prompt if isinstance(prompt, str) else list(prompt),
                max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos, stream=True,
                stream_options={"include_usage": True})
    return body


def chat_body(model: str, text: str, max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    """One user message, greedy, streamed with usage."""
    return {"model": model, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}


async def stream(session: Any, base_url: str, body: dict[str, Any]) -> RequestResult:
    """Post `body` on aiohttp `session` and time its stream; a failure is the result's
    `error`, never an exception, so one bad request does not end a run."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    clock = StreamClock(time.perf_counter())
    try:
        async with session.post(base_url.rstrip("/") + path, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return clock.result(time.perf_counter(), f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                clock.chunk(time.perf_counter(), json.loads(data))
    except Exception as e:  # noqa: BLE001 - reported as this request's error
        return clock.result(time.perf_counter(), repr(e))
    return clock.result(time.perf_counter())


async def stream_once(base_url: str, body: dict[str, Any], timeout_s: float = 600.0
                      ) -> RequestResult:
    """`stream` on a session of its own (one-off probes)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        return await stream(s, base_url, body)
