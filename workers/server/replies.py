"""The two ways an answer goes out: one JSON body, or server-sent events.

Both consume the choices' engine outputs (choices.py) concurrently; a failure
of one choice cancels the others, whose engine requests are aborted on the way
out. A stream sends its headers with the first output, so a request the engine
refuses still gets a real status code; after that, errors travel in-band.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Callable

from aiohttp import web

from kvyard.common import wire

from .choices import Choice, Run, usage_of
from .errors import ApiError, sse_error
from .responses import DONE, Shaper, top_k, vllm_prompt_logprobs


async def gather_all(coros) -> list:
    """Run concurrently; the first failure cancels the others (their engine requests
    are aborted on the way out) and is raised as itself, not as a group."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def complete(choices: list[Choice], shaper: Shaper, n: int,
                   prompt_k: int | None = None, token_text=None,
                   kv_offer: Callable[[Run], dict | None] | None = None) -> web.Response:
    """`prompt_k`: vLLM's `prompt_logprobs` (the prompt's logprobs and top k, per choice
    in completions, once at the top level in chat, whose choices share one prompt)."""
    async def collect(c: Choice) -> tuple[str, str, dict | None, list]:
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
    results = await gather_all(collect(c) for c in choices)
    body = shaper.final([r[:3] for r in results], usage_of(choices, n))
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


async def stream(request: web.Request, choices: list[Choice], shaper: Shaper, n: int,
                 include_usage: bool) -> web.StreamResponse:
    """Headers go out with the first engine output, so a request the engine refuses
    still gets a real status code; after that, errors travel in-band. With n > 1
    the choices' chunks interleave as their tokens come, each with its index."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    ended = object()

    async def merged():
        """(choice, output | ended | exception) as the choices produce them. One choice (the
        common case) is read directly: a queue and a task a choice would cost a task switch
        and two queue operations per token, which at a few hundred streams is a large share of
        the event loop's time."""
        if len(choices) == 1:
            c = choices[0]
            async with aclosing(c.outputs()) as outs:
                async for out in outs:
                    yield c, out
            yield c, ended
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async with aclosing(c.outputs()) as outs:
                    async for out in outs:
                        await queue.put((c, out))
                await queue.put((c, ended))
            except Exception as e:  # noqa: BLE001 - handed to the writer, which raises it
                await queue.put((c, e))

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            live = len(choices)
            while live:
                c, out = await queue.get()
                live -= out is ended
                yield c, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def open_stream() -> None:
        if not resp.prepared:
            await resp.prepare(request)
            if shaper.kind == "chat":  # the role arrives before any content, as with OpenAI
                for c in choices:
                    await resp.write(shaper.chunk("", role=True, index=c.index,
                                                  with_usage_field=include_usage))

    def chunk(c: Choice, text: str | None, reason: str | None = None,
              logprobs: dict | None = None) -> bytes:
        return shaper.chunk(text, reason, with_usage_field=include_usage, logprobs=logprobs,
                            index=c.index)

    items = merged()
    try:
        async for c, out in items:
            if isinstance(out, Exception):
                raise out
            await open_stream()
            if out is ended:
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
            await resp.write(shaper.usage_chunk(usage_of(choices, n)))
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
        pass  # the client left; closing `items` below aborts the unfinished requests
    finally:
        await items.aclose()   # closes the choices' outputs: an unfinished request is aborted
    return resp
