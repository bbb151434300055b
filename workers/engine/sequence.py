"""A request's state inside the engine, shared by the scheduler, block manager and runner.

One object per request, mutated in place by the engine thread only; nothing
outside `kvyard.workers.engine` sees it (the public view is `RequestOutput`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvyard.common.hashing import NONE_HASH, adapter_seed, block_hashes

from .api import RequestOutput, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # parked until its prefill's KV arrives
    WAITING_FOR_KV_LOAD = "waiting_for_kv_load"  # parked while the connector loads its prefix
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]                 # prompt, then every sampled token
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float = 0.0
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0         # leading tokens whose K/V sit in this seq's blocks
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks of token_ids
    num_cached_blocks: int = 0           # leading blocks already registered in the prefix cache
    num_cached_tokens: int = 0           # prompt tokens served from cache at first admission
    admitted_once: bool = False          # counters and cache stats only count first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    generator: Any = None                # torch.Generator when params.seed is set
    detokenizer: Any = None              # incremental detokenizer (tokenizer-provided)
    output_text: str = ""                # detokenized output, stop strings trimmed
    num_emitted_chars: int = 0           # of output_text already streamed
    prompt_logprobs: list[Any] = field(default_factory=list)  # [None, TokenLogprob, ...] as computed
    constraint: Any = None               # guided.constraint.TokenConstraint for guided requests
    stop_scan: Any = None                # stopping.StopScan: this sequence's stop-string automaton state
    hold_kv: bool = False                # P/D prefill: keep the prompt's blocks for a pull
    kv_hold: Any = None                  # ... its kv_holds.KVHold, growing as chunks compute
    pinned_blocks: list[int] = field(default_factory=list)  # P/D decode: loaded remote blocks,
                                         # referenced until admission shares them
    kv_load: Any = None                  # kv_loads.KVLoad it waits for (or came back from)
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft (spec/), verified after it
    spec: Any = None                     # spec.policy.SpecState once it may speculate

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: every prompt position
        must run through the model, so no cached prefix may stand in for it."""
        return self.params.prompt_logprobs is not None \
            and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Hash newly completed full blocks only, so a long generation stays linear."""
        done = len(self.block_hashes)
        if (len(self.token_ids) // block_size) > done:
            parent = self.block_hashes[-1] if done else NONE_HASH
            self.block_hashes += block_hashes(
                self.token_ids[done * block_size:], block_size, parent=parent,
                seed=adapter_seed(self.params.lora_name),
            )
        return self.block_hashes


def output_of(seq: Sequence, new_ids: list[int], delta: str,
              logprobs: list | None = None) -> RequestOutput:
    """The public view of a step's change to `seq`: its new tokens and text."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_ids,
        text_delta=delta,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=logprobs,
    )
