"""OpenAI's response and stream-chunk shapes, field for field.

Kept apart from the request flow so the exact shapes (which the official SDKs
and every dashboard parse) can be read and checked in one place.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvyard.workers.engine.api import TokenLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class Shaper:
    """Builds the bodies of one request; id/created/model repeat in every chunk."""

    kind: str          # "completion" | "chat"
    id: str
    model: str
    created: int = 0

    def __post_init__(self) -> None:
        if not self.created:
            self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, choices: Sequence[tuple[str, str | None, dict[str, Any] | None]],
              usage: Usage) -> dict[str, Any]:
        """choices: (text, finish_reason, logprobs or None) per `index`."""
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        if self.kind == "chat":
            body["choices"] = [{"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": fr}
                               for i, (text, fr, lp) in enumerate(choices)]
        else:
            body["choices"] = [{"index": i, "text": text, "logprobs": lp, "finish_reason": fr}
                               for i, (text, fr, lp) in enumerate(choices)]
        body["usage"] = usage.to_dict()
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, *,
              role: bool = False, with_usage_field: bool = False,
              logprobs: dict[str, Any] | None = None, index: int = 0) -> bytes:
        """One SSE event. `text=None` with a finish_reason makes the closing chunk."""
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
        body["choices"] = [choice]
        if with_usage_field:
            body["usage"] = None  # OpenAI sends an explicit null before the usage chunk
        return sse(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._head(obj)
        body["choices"] = []
        body["usage"] = usage.to_dict()
        return sse(body)


@dataclass(slots=True)
class LogprobsShaper:
    """OpenAI's two logprobs shapes for a run of sampled tokens. Completions (legacy):
    parallel lists, `top_logprobs` a dict per token that also holds the sampled one
    (as vLLM does), `text_offset` counted from the start of the output. Chat: a
    `content` list of {token, logprob, bytes, top_logprobs}. Token strings are
    what each id adds after other text (special tokens as ""), as vLLM reports them."""

    kind: str
    token_text: Callable[[int], str]
    offset: int = 0     # completions: characters of the output before the next token

    def shape(self, entries: Sequence[TokenLogprob | None],
              ids: Sequence[int] = ()) -> dict[str, Any]:
        """`entries` may hold None (an echoed prompt's first token, which has no
        logprob: completions only); its token is then `ids[i]`."""
        text = self.token_text
        if self.kind == "chat":
            return {"content": [
                {**_chat_token(text(e.token_id), e.logprob),
                 "top_logprobs": [_chat_token(text(t), lp) for t, lp in e.top]}
                for e in entries if e is not None]}
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for i, e in enumerate(entries):
            tok = text(ids[i] if e is None else e.token_id)
            tokens.append(tok)
            offsets.append(self.offset)
            self.offset += len(tok)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_clamp(e.logprob))
            top = {text(t): _clamp(lp) for t, lp in e.top}
            top.setdefault(tok, _clamp(e.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}


def top_k(entries: Sequence[TokenLogprob | None], k: int | None) -> list:
    """`entries` with at most k alternatives each (prompt logits computed for a larger k)."""
    k = k or 0
    return [e if e is None or len(e.top) <= k else TokenLogprob(e.token_id, e.logprob, e.top[:k], e.rank)
            for e in entries]


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob | None], k: int,
                         text: Callable[[int], str]) -> list:
    """vLLM's `prompt_logprobs` shape: per prompt position None (the first) or
    {token id: {logprob, rank, decoded_token}} for the prompt token and the k most likely."""
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": _clamp(lp), "rank": r + 1, "decoded_token": text(t)}
             for r, (t, lp) in enumerate(e.top[:k])}
        d[str(e.token_id)] = {"logprob": _clamp(e.logprob), "rank": e.rank,
                              "decoded_token": text(e.token_id)}
        out.append(d)
    return out


def _clamp(lp: float) -> float:
    return lp if lp > _MIN_LOGPROB else _MIN_LOGPROB


def _chat_token(token: str, lp: float) -> dict[str, Any]:
    return {"token": token, "logprob": _clamp(lp), "bytes": list(token.encode("utf-8"))}


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


DONE = b"data: [DONE]\n\n"
