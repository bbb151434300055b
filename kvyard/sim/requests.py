"""A generate request's body as the simulator reads it: the prompt's token ids (tokenized as
the worker tokenizes, through kvyard.common), max_tokens, streaming and usage options.

Mirrors workers/server/prompts.py: completions' text prompts with the tokenizer's special
tokens (BOS), token-id prompts as given, chat through the model's chat template with the
generation prompt; long texts are tokenized in a thread. Only what the simulator needs is
checked; sampling parameters are accepted and ignored (the output is filler).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvyard.common.api import BodyError, error_json, parse_json_object
from kvyard.common.tokenizer import ChatTemplateError, ChatTokenizer

_TOKENIZE_IN_THREAD_CHARS = 8192


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> bytes:
        return error_json(self.status, self.message, self.code, self.param)


@dataclass(slots=True)
class GenerateSpec:
    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str
    raw: dict[str, Any]


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def _int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _bad(f"'{name}' must be a positive integer", name)
    return v


def _prompt(body: dict[str, Any]) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        return p
    if p is None:
        raise _bad("'prompt' is required", "prompt", "missing_required")
    raise _bad("'prompt' must be a string, a list of token ids or a list of one of them "
               "(the simulator serves one prompt per request)", "prompt")


async def _encode(tok: ChatTokenizer, body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("'messages' must be a non-empty list", "messages", "missing_required")
        chars = sum(len(m.get("content") or "") if isinstance(m, dict) and
                    isinstance(m.get("content"), str) else 0 for m in msgs)
        call = lambda: tok.encode_chat(msgs, add_generation_prompt=True)  # noqa: E731
    else:
        p = _prompt(body)
        if not isinstance(p, str):
            if max(p) >= tok.vocab_size:
                raise _bad(f"token id {max(p)} is out of range: the vocabulary has "
                           f"{tok.vocab_size} tokens", "prompt")
            return list(p)
        chars = len(p)
        call = lambda: tok.encode(p, add_special_tokens=True)  # noqa: E731
    try:
        ids = await asyncio.to_thread(call) if chars > _TOKENIZE_IN_THREAD_CHARS else call()
    except ChatTemplateError as e:
        raise _bad(f"messages cannot be rendered with the chat template: {e}", "messages",
                   "invalid_messages") from None
    return list(ids)


async def parse_generate(data: bytes, chat: bool, tok: ChatTokenizer, served: list[str],
                         max_model_len: int) -> GenerateSpec:
    try:
        body = parse_json_object(data)
    except BodyError as e:
        raise ApiError(400, e.message, e.code) from None
    model = body.get("model")
    if model is not None and model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")
    n = body.get("n")
    if n not in (None, 1):
        raise _bad("the simulator serves n=1 only", "n")
    stream = body.get("stream") is True
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, name)
    ids = await _encode(tok, body, chat)
    if not ids:
        raise _bad("the prompt is empty", "messages" if chat else "prompt")
    room = max_model_len - len(ids)
    if max_tokens is None:
        max_tokens = room
    if room < 1 or max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {len(ids) + max(max_tokens, 1)} tokens "
                       f"({len(ids)} in the prompt, {max_tokens} for the completion).",
                       "context_length_exceeded", "max_tokens")
    return GenerateSpec(chat=chat, prompt_ids=ids, max_tokens=max_tokens, stream=stream,
                        include_usage=include_usage, model=model or served[0], raw=body)
