"""The prompt side of a generate request: the validated body, each prompt's token ids.

Both can cost milliseconds for big inputs (JSON parse, stop-string automata and
schemas at validation; tokenizing long text), so past a size they run in a
thread and the event loop keeps serving other requests meanwhile. Texts that
certainly exceed the context are refused before they are tokenized at all.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from kvyard.common.tokenizer import ChatTemplateError

from . import lora_routes
from .body import parse_object, read_body
from .errors import ApiError
from .protocol import GenerateRequest, parse_request
from .state import ServerState, get_state

_TOKENIZE_IN_THREAD_CHARS = 8192  # long prompts are tokenized off the event loop
_VALIDATE_IN_THREAD_BYTES = 16 << 10  # so are big bodies' JSON parse and validation


async def parsed_request(request: web.Request, kind: str) -> GenerateRequest:
    """The validated request. A big body is parsed and validated in a thread, so the
    event loop keeps serving others meanwhile (stop-string automata, schemas)."""
    state = get_state(request.app)
    data = await read_body(request)

    def parse() -> GenerateRequest:
        req = parse_request(parse_object(data), kind, lora_routes.model_names(state),
                            max_model_len=state.engine.max_model_len)
        req.params.lora_name = lora_routes.adapter_for(state, req.model)
        return req
    return await asyncio.to_thread(parse) if len(data) > _VALIDATE_IN_THREAD_BYTES else parse()


def too_long(state: ServerState, chars: int, param: str) -> None:
    """A 400 for a text that certainly has more tokens than the context holds, before
    tokenizing it: no token covers more than `state.max_token_chars` characters."""
    per_token = state.max_token_chars
    limit = state.engine.max_model_len
    if per_token and chars > limit * per_token:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, "
                       f"your prompt has {chars} characters, so at least {-(-chars // per_token)} "
                       "tokens.", param=param, code="context_length_exceeded")


async def prompt_ids(state: ServerState, req: GenerateRequest) -> list[list[int]]:
    """The token ids of each prompt (one for chat)."""
    tok = state.engine.tokenizer
    try:
        if req.messages is not None:
            chars = sum(len(m["content"]) for m in req.messages)
            too_long(state, chars, "messages")  # the template only adds to it
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
            too_long(state, len(p), param)
            call = lambda p=p: tok.encode(p, add_special_tokens=True)  # noqa: E731
            out.append(list(await asyncio.to_thread(call) if len(p) > _TOKENIZE_IN_THREAD_CHARS
                            else call()))
            continue
        check_vocab(state, p, param)
        out.append(p)
    return out


def check_vocab(state: ServerState, ids, param: str) -> None:
    """A 400 naming the first id past the vocabulary (the model would index out of range)."""
    vocab = state.vocab_size
    if vocab and ids and max(ids) >= vocab:
        raise ApiError(400, f"token id {max(ids)} is out of range: the vocabulary has {vocab} "
                       "tokens", param=param, code="invalid_value")
