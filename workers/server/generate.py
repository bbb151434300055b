"""`/v1/completions` and `/v1/chat/completions`: from a request body to tokens out.

This module builds the choices (prompts x n) and the P/D roles of a request;
`prompts.py` parses and tokenizes, `choices.py` drives the engine requests,
`replies.py` writes the answer, `tokenize.py` has `/tokenize` and `/detokenize`.

The one rule that matters here: a request the client no longer waits for must
leave the engine at once, or it keeps its KV blocks and batch slot. aiohttp
cancels the handler when the connection drops (the app runs with
`handler_cancellation=True`), and a failed write ends a stream; both paths go
through `Run.drive`'s `finally` (choices.py), which closes the engine's
generator (its abort path) and aborts the request id explicitly for good measure.
"""
from __future__ import annotations

import dataclasses
import uuid

from aiohttp import web

from kvyard.common import wire
from kvyard.workers.pd.params import stream_id_of, wants_remote_decode

from .choices import Choice, Echo, Run
from .errors import ApiError
from .prompts import check_vocab, parsed_request, prompt_ids
from .protocol import check_length
from .replies import complete, stream
from .responses import LogprobsShaper, Shaper
from .state import ServerState, get_state
from .tokenize import detokenize, tokenize

__all__ = ["chat_completions", "completions", "detokenize", "tokenize"]


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
    req = await parsed_request(request, kind)
    prompts = await prompt_ids(state, req)
    params = req.params
    check_vocab(state, list(params.logit_bias or ()), "logit_bias")
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
            echo = Echo(p if isinstance(p, str) else tok.decode(ids), ids)
        for i in range(req.n):
            p = dataclasses.replace(params, max_tokens=max_tokens)
            if i and p.seed is not None:
                p = dataclasses.replace(p, seed=(p.seed + i) % (1 << 64))
            index = j * req.n + i
            rid = request_id if len(prompts) * req.n == 1 else f"{request_id}-{index}"
            lp = LogprobsShaper(kind, tok.token_text) if p.logprobs is not None else None
            run = Run(state, rid, len(ids))
            if single:
                run.hold_kv = hold_kv
                run.hold_id = stream_id_of(req.raw) if hold_kv else None
                if target is not None:
                    run.remote_kv = state.pd.decoder.remote_kv(target, request.path, req.raw, ids,
                                                                p.lora_name)
            c = Choice(index, ids, run, p, lp, echo)
            if i and share_prefill:
                c.after = choices[-i].prefilled
            choices.append(c)
    if req.stream:
        return await stream(request, choices, shaper, req.n, req.include_usage)
    offer = (lambda run: pd.offer(run.kv_hold.request_id, run.kv_hold) if run.kv_hold else None) \
        if hold_kv else None
    return await complete(choices, shaper, req.n, req.prompt_logprobs, tok.token_text, offer)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")
