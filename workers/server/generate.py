"""`/v1/completions` and `/v1/chat/completions`: from a request body to tokens out.

The one rule that matters here: a request the client no longer waits for must
leave the engine at once, or it keeps its KV blocks and batch slot. aiohttp
cancels the handler when the connection drops (the app runs with
`handler_cancellation=True`), and a failed write ends a stream; both paths go
through `_drive`'s `finally`, which closes the engine's generator (its abort
path) and aborts the request id explicitly for good measure.
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import web

from kvyard.common.tokenizer import ChatTemplateError
from kvyard.workers.engine.api import RequestOutput, SamplingParams
from kvyard.workers.engine.async_engine import EngineError

from .errors import ApiError, sse_error
from .metrics import RequestClock
from .protocol import GenerateRequest, check_length, parse_body, parse_request
from .responses import DONE, LogprobsShaper, Shaper, Usage
from .state import ServerState, get_state

_TOKENIZE_IN_THREAD_CHARS = 8192  # long prompts are tokenized off the event loop


async def _prompt_ids(state: ServerState, req: GenerateRequest) -> list[int]:
    tok = state.engine.tokenizer
    try:
        if req.messages is not None:
            big = sum(len(m["content"]) for m in req.messages) > _TOKENIZE_IN_THREAD_CHARS
            call = lambda: tok.encode_chat(req.messages, add_generation_prompt=True)  # noqa: E731
        elif req.prompt_text is not None:
            big = len(req.prompt_text) > _TOKENIZE_IN_THREAD_CHARS
            call = lambda: tok.encode(req.prompt_text, add_special_tokens=True)  # noqa: E731
        else:
            ids = req.prompt_ids or []
            vocab = state.vocab_size
            if vocab and ids and max(ids) >= vocab:
                raise ApiError(400, f"token id {max(ids)} is out of range: the vocabulary has "
                               f"{vocab} tokens", param="prompt", code="invalid_value")
            return ids
        return list(await asyncio.to_thread(call) if big else call())
    except ChatTemplateError as e:
        raise ApiError(400, f"messages cannot be rendered with the chat template: {e}",
                       param="messages", code="invalid_messages") from None


@dataclass(slots=True)
class _Run:
    """One request inside the engine; remembers how it ended."""

    state: ServerState
    request_id: str
    num_prompt: int
    clock: RequestClock = field(init=False)
    finish_reason: str | None = None
    usage: Usage = field(init=False)

    def __post_init__(self) -> None:
        self.clock = self.state.metrics.clock()
        self.usage = Usage(self.num_prompt, 0)

    async def drive(self, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        engine = self.state.engine
        gen = engine.generate(self.request_id, ids, params)
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
                except EngineError as e:
                    raise ApiError(503, str(e), code="engine_error") from None
                started = True
                self.clock.on_tokens(len(out.new_token_ids))
                self.usage = Usage(out.num_prompt_tokens, out.num_output_tokens,
                                   out.num_cached_tokens)
                if out.finished:
                    self.finish_reason = out.finish_reason or "stop"
                yield out
                if out.finished:
                    return
        finally:
            if not refused:  # a refused request never ran, so it has no outcome to count
                self.clock.finish(self.finish_reason or "abort")
            await gen.aclose()
            if self.finish_reason is None:
                await engine.abort(self.request_id)


@dataclass(slots=True)
class _Echo:
    """Completions' `echo`: the prompt's text, and with logprobs its tokens' entries."""

    text: str
    ids: list[int]

    def first(self, out: RequestOutput, lp_shaper: LogprobsShaper | None) -> dict | None:
        if lp_shaper is None:
            return None
        return lp_shaper.shape(out.prompt_logprobs or [None] * len(self.ids), self.ids)


async def _complete(run: _Run, shaper: Shaper, ids: list[int], params: SamplingParams,
                    lp_shaper: LogprobsShaper | None, echo: _Echo | None) -> web.Response:
    parts: list[str] = [echo.text] if echo else []
    lps: list = []
    lp_json: dict | None = None
    async with aclosing(run.drive(ids, params)) as outs:
        async for out in outs:
            if echo is not None and out.prompt_logprobs is not None:
                lps.extend(out.prompt_logprobs)
            if out.text_delta:
                parts.append(out.text_delta)
            if out.logprobs:
                lps.extend(out.logprobs)
    if run.finish_reason in (None, "abort"):
        raise ApiError(503, "the request was aborted by the server (shutting down?)",
                       code="aborted")
    if lp_shaper is not None:
        lp_json = lp_shaper.shape(lps, ids)
    return web.json_response(shaper.final("".join(parts), run.finish_reason, run.usage,
                                          lp_json))


async def _stream(request: web.Request, run: _Run, shaper: Shaper, ids: list[int],
                  params: SamplingParams, include_usage: bool,
                  lp_shaper: LogprobsShaper | None, echo: _Echo | None) -> web.StreamResponse:
    """Headers go out with the first engine output, so a request the engine refuses
    still gets a real status code; after that, errors travel in-band."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})

    async def open_stream() -> None:
        if not resp.prepared:
            await resp.prepare(request)
            if shaper.kind == "chat":  # the role arrives before any content, as with OpenAI
                await resp.write(shaper.chunk("", role=True, with_usage_field=include_usage))

    try:
        async with aclosing(run.drive(ids, params)) as outs:
            async for out in outs:  # a write cancelled mid-way still closes `outs`
                await open_stream()
                if echo is not None:  # the prompt goes out first, in a chunk of its own
                    await resp.write(shaper.chunk(echo.text, with_usage_field=include_usage,
                                                  logprobs=echo.first(out, lp_shaper)))
                    echo = None
                if lp_shaper is not None and out.logprobs:  # every token's logprobs, text or not
                    await resp.write(shaper.chunk(out.text_delta, with_usage_field=include_usage,
                                                  logprobs=lp_shaper.shape(out.logprobs)))
                elif out.text_delta:
                    await resp.write(shaper.chunk(out.text_delta,
                                                  with_usage_field=include_usage))
        await open_stream()
        if run.finish_reason in (None, "abort"):
            raise ApiError(503, "the request was aborted by the server", code="aborted")
        await resp.write(shaper.chunk(None, run.finish_reason, with_usage_field=include_usage))
        if include_usage:
            await resp.write(shaper.usage_chunk(run.usage))
        await resp.write(DONE)
        await resp.write_eof()
    except ApiError as e:
        if not resp.prepared:
            raise  # nothing sent yet: the middleware answers with the real status
        try:
            await resp.write(sse_error(e))
            await resp.write(DONE)
            await resp.write_eof()
        except ConnectionResetError:
            pass
    except ConnectionResetError:
        pass  # the client left; drive()'s finally has already aborted the request
    return resp


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    state = get_state(request.app)
    body = parse_body(await request.read())
    req = parse_request(body, kind, state.served_names)
    ids = await _prompt_ids(state, req)
    max_tokens = check_length(len(ids), req.max_tokens, state.engine.max_model_len,
                              "messages" if kind == "chat" else "prompt")
    params = dataclasses.replace(req.params, max_tokens=max_tokens)
    vocab = state.vocab_size
    if vocab and params.logit_bias and max(params.logit_bias) >= vocab:
        raise ApiError(400, f"logit_bias token id {max(params.logit_bias)} is out of range: the "
                       f"vocabulary has {vocab} tokens", param="logit_bias", code="invalid_value")
    lp_shaper = echo = None
    tok = state.engine.tokenizer
    if params.logprobs is not None:
        lp_shaper = LogprobsShaper(kind, lambda t: tok.decode([t]))
    if req.echo:
        echo = _Echo(req.prompt_text if req.prompt_text is not None else tok.decode(ids), ids)
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    shaper = Shaper(kind, request_id, req.model)
    run = _Run(state, request_id, len(ids))
    if req.stream:
        return await _stream(request, run, shaper, ids, params, req.include_usage, lp_shaper,
                             echo)
    return await _complete(run, shaper, ids, params, lp_shaper, echo)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `/tokenize`: the ids this server would prefill for a prompt or a chat.

    Lets clients (and tests) build token-id prompts without a tokenizer of their own."""
    state = get_state(request.app)
    body = parse_body(await request.read())
    kind = "chat" if "messages" in body else "completion"
    fields = {k: body[k] for k in ("model", "messages", "prompt") if k in body}
    req = parse_request(fields, kind, state.served_names)
    ids = await _prompt_ids(state, req)
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": state.engine.max_model_len})
