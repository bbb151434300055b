"""OpenAI's response and stream-chunk shapes (completions and chat, streamed or not), field
for field: what the worker and the simulator (kvyard.sim) both answer, kept in one place
so the exact shapes (which the official SDKs and every dashboard parse) can be checked there.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Sequence


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


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


DONE = b"data: [DONE]\n\n"
