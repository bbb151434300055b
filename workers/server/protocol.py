"""Turns an OpenAI request body into what the engine needs, or an `ApiError`.

Validation is strict and explicit because a wrong type that slips through
would surface as an exception deep in the engine's step loop, where it hurts
every request in the batch, not just the bad one. Fields we cannot honour
(best_of, tools, ...) are refused rather than silently ignored, so a client
never gets an answer to a question it did not ask. `n` (up to MAX_N) runs n
engine requests side by side; with a seed, choice i samples with seed + i.

logprobs: completions take an integer (the number of alternatives, as in
OpenAI's legacy API), chat takes `logprobs: true` plus `top_logprobs`; both
are capped at 20 (OpenAI's limit, vLLM's default --max-logprobs).
Completions' `echo` returns the prompt before the output and, with
`logprobs`, the prompt tokens' logprobs too (what lm-eval-harness's
loglikelihood tasks read); such a prompt is computed in full, never taken
from the prefix cache. Chat has no `echo` in OpenAI's API: refused there.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from kvyard.common.api import CHAT_ROLES
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.stopping import StopStrings

from .errors import ApiError
from .guided import guided_params
from .limits import (MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_MESSAGES, MAX_N,
                     MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, check_count, check_stops)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


@dataclass(slots=True)
class GenerateRequest:
    """A validated request: `prompts` (completions: each a text or token ids) or `messages`."""

    kind: str                                  # "completion" | "chat"
    model: str
    params: SamplingParams
    max_tokens: int | None                     # None: fill the remaining context
    stream: bool = False
    include_usage: bool = False
    echo: bool = False                         # completions: prompt text (and logprobs) first
    prompt_logprobs: int | None = None         # vLLM's extra: the prompt's logprobs (+ top k)
    n: int = 1                                 # choices, each its own engine request
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    raw: dict[str, Any] = field(default_factory=dict)  # extensions (e.g. kv_transfer_params)


def _shrink(v: Any, depth: int = 3) -> Any:
    if isinstance(v, list):
        return [_shrink(x, depth - 1) for x in v[:8]] if depth else "..."
    if isinstance(v, dict):
        return {k: _shrink(x, depth - 1) for k, x in itertools.islice(v.items(), 8)} \
            if depth else "..."
    return v[:80] if isinstance(v, str) else v


def _preview(v: Any, chars: int = 80) -> str:
    """The start of `v` as JSON, without serializing all of a huge or deep value."""
    return json.dumps(_shrink(v))[:chars]


def _type_error(name: str, want: str, got: Any) -> ApiError:
    return ApiError(400, f"'{name}' must be {want}, got {_preview(got)}",
                    param=name, code="invalid_type")


def _opt_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    return v


def _opt_num(body: dict[str, Any], name: str, default: float, lo: float, hi: float,
             lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(name, "a number", v)
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise ApiError(400, f"'{name}' must be in {left}{lo}, {hi}], got {v}", param=name,
                       code="invalid_value")
    return float(v)


def token_ids(v: Any, name: str) -> list[int]:
    """`v` as a list of token ids, or a 400 naming the field."""
    if not isinstance(v, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise _type_error(name, "a list of non-negative integers", v)
    return v


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields whose non-default values would change the answer in ways we cannot deliver."""
    checks: list[tuple[str, bool]] = [
        ("suffix", body.get("suffix") not in (None, "")),
        ("best_of", body.get("best_of") not in (None, 1)),
        ("tools", body.get("tools") not in (None, [])),
    ]
    for name, bad in checks:
        if bad:
            raise ApiError(400, f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")


def _sampling(body: dict[str, Any], kind: str) -> SamplingParams:
    top_k = _opt_int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise ApiError(400, f"'top_k' must be -1 (disabled) or positive, got {top_k}",
                       param="top_k", code="invalid_value")
    stop = body.get("stop")
    if isinstance(stop, list):  # the count first: a list past it is not looked at
        check_count("stop", stop, MAX_STOP_STRINGS, "stop strings")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise _type_error("stop", "a string or a list of strings", stop)
    check_stops(stops)
    seed = _opt_int(body, "seed")
    if seed is not None and not -(1 << 63) <= seed < (1 << 64):
        raise ApiError(400, f"'seed' must fit in 64 bits, got {seed}", param="seed",
                       code="invalid_value")
    stop_ids = body.get("stop_token_ids")
    if isinstance(stop_ids, list):
        check_count("stop_token_ids", stop_ids, MAX_STOP_TOKEN_IDS, "token ids")
    min_tokens = _opt_int(body, "min_tokens") or 0
    if min_tokens < 0:
        raise ApiError(400, f"'min_tokens' must be >= 0, got {min_tokens}", param="min_tokens",
                       code="invalid_value")
    return SamplingParams(
        temperature=_opt_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_opt_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=-1 if not top_k else top_k,
        seed=seed,
        stop=StopStrings(stops) if stops else [],  # its automaton, built once here
        stop_token_ids=[] if stop_ids is None else token_ids(stop_ids, "stop_token_ids"),
        ignore_eos=_opt_bool(body, "ignore_eos"),
        logprobs=_logprobs(body, kind),
        presence_penalty=_opt_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_opt_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_opt_num(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        min_tokens=min_tokens,
        logit_bias=_logit_bias(body),
        **guided_params(body),
    )


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    """Completions: `logprobs` is the number of alternatives. Chat: `logprobs` is a
    boolean and `top_logprobs` (which needs it) the number of alternatives."""
    if kind == "chat":
        on = _opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs")
        if top is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                           code="invalid_value")
        n, name = (top or 0, "top_logprobs") if on else (None, "")
    else:
        n, name = _opt_int(body, "logprobs"), "logprobs"
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {n}", param=name,
                       code="invalid_value")
    return n


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """OpenAI's map of token id (a string key) to a bias in [-100, 100]."""
    lb = body.get("logit_bias")
    if lb is None or lb == {}:
        return None
    if not isinstance(lb, dict):
        raise _type_error("logit_bias", "an object of token id -> bias", lb)
    check_count("logit_bias", lb, MAX_LOGIT_BIAS, "entries")
    out: dict[int, float] = {}
    for k, v in lb.items():
        if not isinstance(k, str) or not k.isdigit():
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {k!r}",
                           param="logit_bias", code="invalid_value")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got "
                           f"{_preview(v, 40)}", param="logit_bias", code="invalid_value")
        out[int(k)] = float(v)
    return out


def _max_tokens(body: dict[str, Any], kind: str) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    v = _opt_int(body, name)
    if v is not None and v <= 0:
        raise ApiError(400, f"'{name}' must be at least 1, got {v}", param=name,
                       code="invalid_value")
    if v is None and kind == "completion":
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return v


def _text_content(content: Any, i: int) -> str:
    """Chat content as plain text: a string, or a list of {"type": "text"} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content", code="invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(f"messages[{i}].content", "a string or a list of text parts", content)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages",
                       code="invalid_value")
    check_count("messages", msgs, MAX_MESSAGES, "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _type_error(f"messages[{i}].role", "a non-empty string", role)
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of "
                           f"{', '.join(sorted(CHAT_ROLES))}, got {_preview(role, 40)}",
                           param=f"messages[{i}].role", code="invalid_value")
        content = m.get("content")
        if content is None and role != "assistant":
            raise ApiError(400, f"messages[{i}].content is required", param=f"messages[{i}]",
                           code="missing_required")
        msg = {"role": role, "content": "" if content is None else _text_content(content, i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _prompt(body: dict[str, Any], req: GenerateRequest, max_model_len: int | None) -> None:
    """A text, token ids, or a batch of either (OpenAI's completions; lm-eval sends batches).
    Token ids past `max_model_len` are refused by their count, before each is checked."""
    p = body.get("prompt")
    if p is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required")
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise _type_error("prompt", "a string, a non-empty list of token ids, or a list of those", p)
    if len(p) * req.n > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} choices per request (prompts x n), got "
                       f"{len(p)} x {req.n}", param="prompt", code="invalid_value")
    for i, x in enumerate(p):
        if isinstance(x, str):
            req.prompts.append(x)
        elif isinstance(x, list) and x:
            param = "prompt" if len(p) == 1 else f"prompt[{i}]"
            if max_model_len:
                check_length(len(x), None, max_model_len, param)
            req.prompts.append(token_ids(x, param))
        else:
            raise _type_error("prompt" if len(p) == 1 else f"prompt[{i}]",
                              "a string or a non-empty list of token ids", x)


def parse_request(body: dict[str, Any], kind: str, served_names: list[str], *,
                  max_model_len: int | None = None) -> GenerateRequest:
    """Validates `body` for `kind` ("completion" or "chat") against the served model names
    (and, given the context length, token-id prompts against it)."""
    model = body.get("model", served_names[0])
    if model is None:
        model = served_names[0]
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model not in served_names:
        raise ApiError(404, f"The model `{model}` does not exist. Served: "
                       f"{', '.join(served_names)}", param="model", code="model_not_found")
    n = _opt_int(body, "n")
    if n is None:
        n = 1
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be in [1, {MAX_N}], got {n}", param="n",
                       code="invalid_value")
    _refuse_unsupported(body)
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                           param="stream_options", code="invalid_value")
        if not isinstance(opts, dict):
            raise _type_error("stream_options", "an object", opts)
        include_usage = _opt_bool(opts, "include_usage")
    req = GenerateRequest(kind=kind, model=model, params=_sampling(body, kind),
                          max_tokens=_max_tokens(body, kind), stream=stream,
                          include_usage=include_usage, n=n, raw=body)
    req.prompt_logprobs = _opt_int(body, "prompt_logprobs")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got "
                           f"{req.prompt_logprobs}", param="prompt_logprobs", code="invalid_value")
        if stream:  # as vLLM: they would all come before the first token anyway
            raise ApiError(400, "'prompt_logprobs' are not available when 'stream' is true",
                           param="prompt_logprobs", code="invalid_value")
    if kind == "chat":
        if body.get("echo") not in (None, False):
            raise ApiError(400, "'echo' is not supported for chat completions", param="echo",
                           code="unsupported_parameter")
        req.messages = _messages(body)
    else:
        req.echo = _opt_bool(body, "echo")
        _prompt(body, req, max_model_len)
    return req


def check_length(num_prompt: int, max_tokens: int | None, max_model_len: int,
                 prompt_param: str = "prompt") -> int:
    """The max_tokens to run with; refuses prompts that cannot fit, saying the numbers."""
    if num_prompt == 0:
        raise ApiError(400, "the prompt is empty", param=prompt_param, code="invalid_value")
    if num_prompt >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your prompt has {num_prompt} tokens, leaving no room for "
                       "output.", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {num_prompt + max_tokens} tokens "
                       f"({num_prompt} in the prompt, {max_tokens} for the completion). "
                       "Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    return max_tokens
