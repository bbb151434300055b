"""Offline batch generation: prompts in, finished outputs out, no event loop.

For tests and benchmarks that want the engine's batching without a server.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence as Seq

from .api import SamplingParams, TokenLogprob
from .config import EngineConfig
from .llm_engine import LLMEngine


@dataclass(slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when params.prompt_logprobs is


class LLM:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine.from_config(config or EngineConfig())
        self._ids = itertools.count()

    def generate(self, prompts: Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[CompletionOutput]:
        """All prompts are queued at once and batched together; results keep the prompts' order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, CompletionOutput] = {}
        order: list[str] = []
        for ids, p in zip(prompts, params):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, ids, p)
            results[rid] = CompletionOutput(rid, list(ids))
            order.append(rid)
        pending = set(order)
        while pending:
            outs = self.engine.step()
            if not outs and not self.engine.has_unfinished_requests():
                break
            for o in outs:
                r = results.get(o.request_id)
                if r is None:
                    continue
                r.token_ids += o.new_token_ids
                r.text += o.text_delta
                r.num_cached_tokens = o.num_cached_tokens
                if o.logprobs:
                    r.logprobs += o.logprobs
                if o.prompt_logprobs is not None:
                    r.prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    r.finish_reason = o.finish_reason
                    pending.discard(o.request_id)
        return [results[rid] for rid in order]
