"""OpenAI's response and stream-chunk shapes, field for field.

Kept apart from the request flow so the exact shapes (which the official SDKs
and every dashboard parse) can be read and checked in one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvyard.common.openai_shapes import DONE, Shaper, Usage, sse  # noqa: F401 - re-exported
from kvyard.workers.engine.api import TokenLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


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
