"""A generate request's answers as engine requests (`n` choices per prompt).

`Run` drives one engine request and remembers how it ended; its `finally` is
where a request the client no longer waits for leaves the engine (see
generate.py). `Choice` is one answer: its run, sampling parameters, logprobs
shaping and echo, and the wait that lets samples after the first share the
first's prefill.
"""
from __future__ import annotations

import asyncio
import inspect
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from kvyard.workers.engine.api import RequestOutput, SamplingParams
from kvyard.workers.engine.async_engine import EngineError, EngineSleeping

from .errors import ApiError
from .metrics import RequestClock
from .responses import LogprobsShaper, Usage
from .state import ServerState


@dataclass(slots=True)
class Run:
    """One request inside the engine; remembers how it ended."""

    state: ServerState
    request_id: str
    num_prompt: int
    clock: RequestClock = field(init=False)
    finish_reason: str | None = None
    usage: Usage = field(init=False)
    hold_kv: bool = False               # P/D prefill for another worker: keep the blocks
    hold_id: str | None = None          # ... under the decode worker's stream id
    remote_kv: Any = None               # P/D decode: a coroutine giving the prompt's KV
    kv_hold: Any = None                 # the engine's hold, once a hold_kv request ended

    def __post_init__(self) -> None:
        self.clock = self.state.metrics.clock()
        self.usage = Usage(self.num_prompt, 0)

    async def drive(self, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        engine = self.state.engine
        pd_kw: dict[str, Any] = {}
        if self.hold_kv:
            pd_kw.update(hold_kv=True, hold_id=self.hold_id)
        if self.remote_kv is not None:
            pd_kw["remote_kv"] = self.remote_kv
        gen = engine.generate(self.request_id, ids, params, **pd_kw)
        started = refused = False
        try:
            while True:
                try:
                    out = await anext(gen)
                except StopAsyncIteration:
                    return
                except ValueError as e:  # refused before it ran: the request's fault
                    if started:
                        raise
                    refused = True
                    raise ApiError(400, str(e), code="invalid_request") from None
                except EngineSleeping as e:  # slept between the server's check and the engine
                    raise ApiError(503, str(e), code="model_sleeping") from None
                except EngineError as e:
                    raise ApiError(503, str(e), code="engine_error") from None
                started = True
                self.clock.on_tokens(len(out.new_token_ids))
                self.usage = Usage(out.num_prompt_tokens, out.num_output_tokens,
                                   out.num_cached_tokens)
                if out.finished:
                    self.finish_reason = out.finish_reason or "stop"
                    self.kv_hold = out.kv_hold
                yield out
                if out.finished:
                    return
        finally:
            if not refused:  # a refused request never ran, so it has no outcome to count
                self.clock.finish(self.finish_reason or "abort")
            await gen.aclose()
            if inspect.iscoroutine(self.remote_kv) and \
                    inspect.getcoroutinestate(self.remote_kv) == inspect.CORO_CREATED:
                self.remote_kv.close()  # refused before the engine took it
            if self.finish_reason is None:
                await engine.abort(self.request_id)


@dataclass(slots=True)
class Echo:
    """Completions' `echo`: the prompt's text, and with logprobs its tokens' entries."""

    text: str
    ids: list[int]


@dataclass(slots=True)
class Choice:
    """One of the request's answers (prompt p, sample i of n: index p * n + i): its own
    engine request, sampling parameters (seed + i, as vLLM derives them) and
    logprobs offsets."""

    index: int
    ids: list[int]
    run: Run
    params: SamplingParams
    lp: LogprobsShaper | None
    echo: Echo | None
    after: asyncio.Event | None = None     # the first sample's `prefilled`, for the others
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's outputs. Samples after the first of a prompt start once the first
        has its first token: the prompt's full blocks are in the prefix cache by then, so
        n samples prefill the prompt once, not n times side by side."""
        try:
            if self.after is not None:
                await self.after.wait()
            async with aclosing(self.run.drive(self.ids, self.params)) as outs:
                async for out in outs:
                    self.prefilled.set()
                    yield out
        finally:
            self.prefilled.set()  # ended or failed: never leave the others waiting

    def prompt_part(self, out: RequestOutput) -> dict | None:
        """The echoed prompt's logprobs (at the first output), when asked for."""
        if self.lp is None or self.echo is None:
            return None
        ids = self.echo.ids
        return self.lp.shape(out.prompt_logprobs or [None] * len(ids), ids)

    def check_finished(self) -> str:
        if self.run.finish_reason in (None, "abort"):
            raise ApiError(503, "the request was aborted by the server (shutting down?)",
                           code="aborted")
        return self.run.finish_reason


def usage_of(choices: list[Choice], n: int) -> Usage:
    """Each prompt once, every choice's completion tokens (OpenAI's and vLLM's count)."""
    us = [c.run.usage for c in choices]
    return Usage(sum(u.prompt_tokens for u in us[::n]), sum(u.completion_tokens for u in us),
                 sum(u.cached_tokens for u in us[::n]))
