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
import inspect
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from kvyard.common import wire
from kvyard.common.tokenizer import ChatTemplateError
from kvyard.workers.engine.api import RequestOutput, SamplingParams
from kvyard.workers.engine.async_engine import EngineError, EngineSleeping
from kvyard.workers.pd.params import wants_remote_decode

from .body import parse_object, read_body
from .errors import ApiError, sse_error
from .metrics import RequestClock
from .protocol import GenerateRequest, check_length, parse_request, token_ids
from .responses import DONE, LogprobsShaper, Shaper, Usage, top_k, vllm_prompt_logprobs
from .state import ServerState, get_state

_TOKENIZE_IN_THREAD_CHARS = 8192  # long prompts are tokenized off the event loop
_VALIDATE_IN_THREAD_BYTES = 16 << 10  # so are big bodies' JSON parse and validation


async def _parsed(request: web.Request, kind: str) -> GenerateRequest:
    """The validated request. A big body is parsed and validated in a thread, so the
    event loop keeps serving others meanwhile (stop-string automata, schemas)."""
    state = get_state(request.app)
    data = await read_body(request)

    def parse() -> GenerateRequest:
        return parse_request(parse_object(data), kind, state.served_names,
                             max_model_len=state.engine.max_model_len)
    return await asyncio.to_thread(parse) if len(data) > _VALIDATE_IN_THREAD_BYTES else parse()


def _too_long(state: ServerState, chars: int, param: str) -> None:
    """A 400 for a text that certainly has more tokens than the context holds, before
    tokenizing it: no token covers more than `state.max_token_chars` characters."""
    per_token = state.max_token_chars
    limit = state.engine.max_model_len
    if per_token and chars > limit * per_token:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, "
                       f"your prompt has {chars} characters, so at least {-(-chars // per_token)} "
                       "tokens.", param=param, code="context_length_exceeded")


async def _prompt_ids(state: ServerState, req: GenerateRequest) -> list[list[int]]:
    """The token ids of each prompt (one for chat)."""
    tok = state.engine.tokenizer
    try:
        if req.messages is not None:
            chars = sum(len(m["content"]) for m in req.messages)
            _too_long(state, chars, "messages")  # the template only adds to it
            big = chars > _TOKENIZE_IN_THREAD_CHARS
            call = lambda: [tok.encode_chat(req.messages, add_generation_prompt=True)]  # noqa: E731
            return await asyncio.to_thread(call) if big else call()
    except ChatTemplateError as e:
        raise ApiError(400, f"messages cannot be rendered with the chat template: {e}",
                       param="messages", code="invalid_messages") from None
    out: list[list[int]] = []
    for i, p in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            _too_long(state, len(p), param)
            call = lambda p=p: tok.encode(p, add_special_tokens=True)  # noqa: E731
            out.append(list(await asyncio.to_thread(call) if len(p) > _TOKENIZE_IN_THREAD_CHARS
                            else call()))
            continue
        _check_vocab(state, p, param)
        out.append(p)
    return out


def _check_vocab(state: ServerState, ids, param: str) -> None:
    """A 400 naming the first id past the vocabulary (the model would index out of range)."""
    vocab = state.vocab_size
    if vocab and ids and max(ids) >= vocab:
        raise ApiError(400, f"token id {max(ids)} is out of range: the vocabulary has {vocab} "
                       "tokens", param=param, code="invalid_value")


@dataclass(slots=True)
class _Run:
    """One request inside the engine; remembers how it ended."""

    state: ServerState
    request_id: str
    num_prompt: int
    clock: RequestClock = field(init=False)
    finish_reason: str | None = None
    usage: Usage = field(init=False)
    hold_kv: bool = False               # P/D prefill for another worker: keep the blocks
    remote_kv: Any = None               # P/D decode: a coroutine giving the prompt's KV
    kv_hold: Any = None                 # the engine's hold, once a hold_kv request ended

    def __post_init__(self) -> None:
        self.clock = self.state.metrics.clock()
        self.usage = Usage(self.num_prompt, 0)

    async def drive(self, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        engine = self.state.engine
        pd_kw: dict[str, Any] = {}
        if self.hold_kv:
            pd_kw["hold_kv"] = True
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
class _Echo:
    """Completions' `echo`: the prompt's text, and with logprobs its tokens' entries."""

    text: str
    ids: list[int]


@dataclass(slots=True)
class _Choice:
    """One of the request's answers (prompt p, sample i of n: index p * n + i): its own
    engine request, sampling parameters (seed + i, as vLLM derives them) and
    logprobs offsets."""

    index: int
    ids: list[int]
    run: _Run
    params: SamplingParams
    lp: LogprobsShaper | None
    echo: _Echo | None
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


def _usage(choices: list[_Choice], n: int) -> Usage:
    """Each prompt once, every choice's completion tokens (OpenAI's and vLLM's count)."""
    us = [c.run.usage for c in choices]
    return Usage(sum(u.prompt_tokens for u in us[::n]), sum(u.completion_tokens for u in us),
                 sum(u.cached_tokens for u in us[::n]))


async def _all(coros) -> list:
    """Run concurrently; the first failure cancels the others (their engine requests
    are aborted on the way out) and is raised as itself, not as a group."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _complete(choices: list[_Choice], shaper: Shaper, n: int,
                    prompt_k: int | None = None, token_text=None,
                    kv_offer: Callable[[_Run], dict | None] | None = None) -> web.Response:
    """`prompt_k`: vLLM's `prompt_logprobs` (the prompt's logprobs and top k, per choice
    in completions, once at the top level in chat, whose choices share one prompt)."""
    async def collect(c: _Choice) -> tuple[str, str, dict | None, list]:
        parts: list[str] = [c.echo.text] if c.echo else []
        lps: list = []
        plps: list = []
        async with aclosing(c.outputs()) as outs:
            async for out in outs:
                if out.prompt_logprobs is not None:
                    if c.echo is not None:
                        lps.extend(top_k(out.prompt_logprobs, c.params.logprobs))
                    plps.extend(out.prompt_logprobs)
                if out.text_delta:
                    parts.append(out.text_delta)
                if out.logprobs:
                    lps.extend(out.logprobs)
        reason = c.check_finished()
        return "".join(parts), reason, c.lp.shape(lps, c.ids) if c.lp else None, plps
    results = await _all(collect(c) for c in choices)
    body = shaper.final([r[:3] for r in results], _usage(choices, n))
    if prompt_k is not None:
        shaped = [vllm_prompt_logprobs(r[3], prompt_k, token_text) for r in results]
        if shaper.kind == "chat":
            body["prompt_logprobs"] = shaped[0]
        else:
            for choice, pl in zip(body["choices"], shaped):
                choice["prompt_logprobs"] = pl
    if kv_offer is not None and (offer := kv_offer(choices[0].run)) is not None:
        body[wire.KV_TRANSFER_PARAMS] = offer
    return web.json_response(body)


async def _stream(request: web.Request, choices: list[_Choice], shaper: Shaper, n: int,
                  include_usage: bool) -> web.StreamResponse:
    """Headers go out with the first engine output, so a request the engine refuses
    still gets a real status code; after that, errors travel in-band. With n > 1
    the choices' chunks interleave as their tokens come, each with its index."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(c: _Choice) -> None:
        try:
            async with aclosing(c.outputs()) as outs:
                async for out in outs:
                    await queue.put((c, out))
            await queue.put((c, ended))
        except Exception as e:  # noqa: BLE001 - handed to the writer, which raises it
            await queue.put((c, e))

    async def open_stream() -> None:
        if not resp.prepared:
            await resp.prepare(request)
            if shaper.kind == "chat":  # the role arrives before any content, as with OpenAI
                for c in choices:
                    await resp.write(shaper.chunk("", role=True, index=c.index,
                                                  with_usage_field=include_usage))

    def chunk(c: _Choice, text: str | None, reason: str | None = None,
              logprobs: dict | None = None) -> bytes:
        return shaper.chunk(text, reason, with_usage_field=include_usage, logprobs=logprobs,
                            index=c.index)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        live = len(choices)
        while live:
            c, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            await open_stream()
            if out is ended:
                live -= 1
                await resp.write(chunk(c, None, c.check_finished()))
                continue
            if c.echo is not None:  # the prompt goes out first, in a chunk of its own
                await resp.write(chunk(c, c.echo.text, logprobs=c.prompt_part(out)))
                c.echo = None
            if c.lp is not None and out.logprobs:  # every token's logprobs, text or not
                await resp.write(chunk(c, out.text_delta, logprobs=c.lp.shape(out.logprobs)))
            elif out.text_delta:
                await resp.write(chunk(c, out.text_delta))
        if include_usage:
            await resp.write(shaper.usage_chunk(_usage(choices, n)))
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
        pass  # the client left; the pumps' drive() aborts their requests below
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return resp


def _prefill_target(state: ServerState, request: web.Request) -> str | None:
    """The signed x-prefiller-host-port target, checked before anything else (a 403
    otherwise: see kvyard.workers.pd.decode)."""
    pd = state.pd
    if pd is not None and pd.decoder is not None:
        return pd.decoder.authorize(request.headers)
    if wire.PREFILLER_HEADER in request.headers:
        raise ApiError(403, "prefill target refused: this worker does no P/D",
                       param=wire.PREFILLER_HEADER, code="prefill_target_refused")
    return None


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    state = get_state(request.app)
    target = _prefill_target(state, request)
    req = await _parsed(request, kind)
    prompts = await _prompt_ids(state, req)
    params = req.params
    _check_vocab(state, list(params.logit_bias or ()), "logit_bias")
    want = [k for k in (params.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    if want:  # echo's logprobs and vLLM's prompt_logprobs come from the same prompt logits
        params = dataclasses.replace(params, prompt_logprobs=max(want))
    tok = state.engine.tokenizer
    config = getattr(state.engine, "config", None)
    share_prefill = params.prompt_logprobs is None and getattr(config, "enable_prefix_caching", False)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    shaper = Shaper(kind, request_id, req.model)
    single = len(prompts) == 1 and req.n == 1 and params.prompt_logprobs is None
    pd = state.pd
    hold_kv = single and not req.stream and pd is not None and pd.peer is not None \
        and wants_remote_decode(req.raw)
    if target is not None and not single:
        pd.decoder.unsupported()  # n > 1, batches and prompt logprobs prefill here
    choices = []
    for j, ids in enumerate(prompts):
        max_tokens = check_length(len(ids), req.max_tokens, state.engine.max_model_len,
                                  "messages" if kind == "chat" else "prompt")
        echo = None
        if req.echo:
            p = req.prompts[j]
            echo = _Echo(p if isinstance(p, str) else tok.decode(ids), ids)
        for i in range(req.n):
            p = dataclasses.replace(params, max_tokens=max_tokens)
            if i and p.seed is not None:
                p = dataclasses.replace(p, seed=(p.seed + i) % (1 << 64))
            index = j * req.n + i
            rid = request_id if len(prompts) * req.n == 1 else f"{request_id}-{index}"
            lp = LogprobsShaper(kind, tok.token_text) if p.logprobs is not None else None
            run = _Run(state, rid, len(ids))
            if single:
                run.hold_kv = hold_kv
                if target is not None:
                    run.remote_kv = state.pd.decoder.remote_kv(target, request.path, req.raw, ids)
            c = _Choice(index, ids, run, p, lp, echo)
            if i and share_prefill:
                c.after = choices[-i].prefilled
            choices.append(c)
    if req.stream:
        return await _stream(request, choices, shaper, req.n, req.include_usage)
    offer = (lambda run: pd.offer(run.request_id, run.kv_hold) if run.kv_hold else None) \
        if hold_kv else None
    return await _complete(choices, shaper, req.n, req.prompt_logprobs, tok.token_text, offer)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `/tokenize`: the ids this server would prefill for a prompt or a chat.

    Lets clients (and tests) build token-id prompts without a tokenizer of their own."""
    state = get_state(request.app)
    body = parse_object(await read_body(request))
    kind = "chat" if "messages" in body else "completion"
    fields = {k: body[k] for k in ("model", "messages", "prompt") if k in body}
    req = parse_request(fields, kind, state.served_names, max_model_len=state.engine.max_model_len)
    prompts = await _prompt_ids(state, req)
    if len(prompts) != 1:
        raise ApiError(400, "/tokenize takes one prompt", param="prompt", code="invalid_value")
    ids = prompts[0]
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": state.engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's `/detokenize`: {"tokens": [ids]} -> {"prompt": text}."""
    state = get_state(request.app)
    body = parse_object(await read_body(request))
    ids = token_ids(body.get("tokens"), "tokens")
    _check_vocab(state, ids, "tokens")
    return web.json_response({"prompt": state.engine.tokenizer.decode(ids)})
