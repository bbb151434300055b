"""The engine's public contract: what the server, benchmarks and KV connectors use.

Everything else in `kvyard.workers.engine` is internal. Names follow vLLM's
where the concept is the same so users' habits carry over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0      # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1               # -1 disables
    seed: int | None = None       # per-request generator: same seed, same tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the sampled token's logprob plus the k most likely (vLLM's
    # default "raw" mode: log_softmax of the model's logits, before penalties and temperature)
    logprobs: int | None = None
    # None: none; k >= 0: each prompt token's logprob given the tokens before it, plus the k
    # most likely there (the first token has none). Such a prompt runs through the model
    # in full: prefix-cache and kvstore hits would leave positions without logits.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0     # OpenAI semantics: over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # vLLM's: over prompt and output tokens, > 1 discourages
    min_tokens: int = 0               # EOS and stop_token_ids are masked until this many
    logit_bias: dict[int, float] | None = None
    json_object: bool = False         # response_format json_object: the output is one JSON object
    json_schema: dict | None = None   # response_format json_schema / guided_json: one JSON
                                      # object satisfying this schema (guided/schema.py)
    guided_choice: list[str] | None = None  # vLLM's guided_choice: the output is one of these
    guided_regex: str | None = None   # vLLM's guided_regex: the whole output matches it
    lora_name: str | None = None      # the LoRA adapter this request runs with (None: the base model)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.logit_bias) or self.repetition_penalty != 1.0


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's log-probability and the `logprobs` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]      # (token id, logprob), most likely first
    rank: int | None = None           # prompt tokens: 1 + how many tokens were more likely


@dataclass(slots=True)
class RequestOutput:
    """One increment of a request's progress (streamed), or its end."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str               # stop strings already trimmed
    finished: bool
    finish_reason: str | None     # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int        # prompt tokens served from the prefix cache or kvstore
    logprobs: list[TokenLogprob] | None = None  # one per new_token_ids entry, if requested
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, if requested
    kv_hold: Any = None           # P/D prefill (hold_kv): the final output's kv_holds.KVHold


@dataclass(slots=True)
class RemoteKV:
    """Leading prompt blocks computed elsewhere (a P/D prefill), for a parked request:
    `payloads[i]` is block i in kvstore.layout's block layout, already verified."""

    block_hashes: list[int]
    payloads: list[Any]


@dataclass(slots=True)
class EngineStats:
    """A snapshot for /metrics and the EPP's scrapes."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float         # 0..1, blocks in use by live sequences
    num_blocks: int
    block_size: int
    prefix_queries_tokens: int    # cumulative, vLLM semantics (tokens, not blocks)
    prefix_hits_tokens: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prompt_tokens_pending: int = 0  # prompt tokens not computed yet: queued, parked, mid-prefill
    max_lora: int = 0               # --max-loras with LoRA on, else 0 (then no LoRA metric)
    running_lora_adapters: list[str] = field(default_factory=list)  # adapters of running requests
    waiting_lora_adapters: list[str] = field(default_factory=list)  # ... of waiting ones
    spec_decode: Any = None       # spec.stats.SpecDecodeStats with speculative decoding on


class KVConnector(Protocol):
    """Hook for an external KV store (kvstore) or a P/D transfer.

    The engine binds the per-layer KV cache tensors once, then, for a request
    whose prefix misses the local prefix cache, asks how many leading blocks
    the connector has and has them copied into freshly allocated blocks before
    prefill; after prefill it hands over newly computed full blocks to save.
    `block_hashes` are `kvyard.common.hashing.block_hashes` values.
    """

    def bind(self, kv_caches: Sequence[object], block_size: int) -> None: ...
    def lookup(self, block_hashes: Sequence[int]) -> int: ...
    def load(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> int: ...
    def save(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> None: ...
