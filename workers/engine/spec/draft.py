"""vLLM's `draft_model` proposer: a smaller model drafts k tokens greedily, batched.

The draft keeps a KV cache of its own with the target's geometry (same block count and
size) and indexes it through the target sequence's block table, so it needs no block
manager: the scheduler reserves the slots for 1 + k positions before the draft runs, and
the draft writes positions c .. c + k - 1 (c = the last token's position) there. Each
sequence's `SpecState.draft_computed` says how much of its draft KV is valid; a propose
first catches up on what the target computed since (the whole prompt the first time,
prefix-cache hits included), in one batched step, then runs k - 1 batched decode steps.
Rejected positions are simply overwritten later. A preemption resets the count.

Offline the only model is the demo; `draft_layers` makes a layer-truncated copy (the
target's first N decoder layers with its final norm and head: shared weights, no second
load when the draft names the target's model and dtype), `draft_dtype` a copy at another
precision. Any HF/GGUF model with the target's tokenizer works as `model`.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from kvyard.workers.attention import AttentionMetadata

from ..sequence import Sequence
from .config import SpeculativeConfig
from .policy import SpecState


def truncated(model: Any, layers: int) -> Any:
    """A view of `model` running only its first `layers` decoder layers (weights shared)."""
    if layers >= len(model.layers):
        return model
    view = copy.copy(model)
    object.__setattr__(view, "layers", list(model.layers[:layers]))
    return view


def load_draft(cfg: SpeculativeConfig, target: Any, target_model_name: str, target_dtype: torch.dtype,
               max_model_len: int | None) -> Any:
    """The draft model: the target itself (truncated) when it names the same model and dtype."""
    from kvyard.common.models import resolve_model
    from kvyard.workers.model import load_model

    from ..model_runner import resolve_dtype

    dtype = resolve_dtype(cfg.draft_dtype, target.device) if cfg.draft_dtype else target_dtype
    if cfg.model == target_model_name and dtype == target_dtype:
        model = target
    else:
        model, _ = load_model(resolve_model(cfg.model), dtype, max_model_len, device=target.device)
    return truncated(model, cfg.draft_layers) if cfg.draft_layers else model


class DraftProposer:
    def __init__(self, model: Any, num_blocks: int, block_size: int) -> None:
        self.model = model
        c = model.config
        shape = (2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.block_size = block_size

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """k greedy draft tokens per sequence; its blocks must cover positions up to
        num_tokens - 1 + k."""
        for s in seqs:
            st: SpecState = s.spec
            if st.preemptions != s.num_preemptions:     # its blocks were freed: start over
                st.draft_computed, st.preemptions = 0, s.num_preemptions
            # past the verified tokens the draft wrote its own rejected guesses
            st.draft_computed = min(st.draft_computed, s.num_computed_tokens)
        chunks = [s.token_ids[s.spec.draft_computed:] for s in seqs]
        starts = [s.spec.draft_computed for s in seqs]
        out = [[t] for t in self._step(seqs, chunks, starts)]
        for j in range(1, max(ks)):
            live = [i for i, k in enumerate(ks) if k > j]
            toks = self._step([seqs[i] for i in live], [[out[i][-1]] for i in live],
                              [seqs[i].num_tokens + j - 1 for i in live])
            for i, t in zip(live, toks):
                out[i].append(t)
        for s, k in zip(seqs, ks):
            s.spec.draft_computed = s.num_tokens - 1 + k
        return [o[:k] for o, k in zip(out, ks)]

    def _step(self, seqs: list[Sequence], chunks: list[list[int]], starts: list[int]) -> list[int]:
        """One batched forward of `chunks` at positions from `starts`; the argmax after each."""
        bs = self.block_size
        order = sorted(range(len(seqs)), key=lambda i: len(chunks[i]) != 1)  # decodes first
        ids: list[int] = []
        pos: list[int] = []
        qsl = [0]
        lens: list[int] = []
        tables: list[list[int]] = []
        for i in order:
            ids += chunks[i]
            pos += range(starts[i], starts[i] + len(chunks[i]))
            qsl.append(len(ids))
            lens.append(starts[i] + len(chunks[i]))
            tables.append(seqs[i].block_table)
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        p = torch.tensor(pos, dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(len(tables)),
                                      torch.tensor([len(chunks[i]) for i in order]))
        slots = bt[row, p // bs] * bs + p % bs
        dev = self.model.device
        meta = AttentionMetadata(slot_mapping=slots.to(dev), query_start_loc=qsl, seq_lens=lens,
                                 block_tables=bt.to(dev),
                                 num_decodes=sum(1 for i in order if len(chunks[i]) == 1))
        last = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=dev)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev), p.to(dev),
                                    self.kv_caches, meta, last)
        toks = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
        res = [0] * len(seqs)
        for j, i in enumerate(order):
            res[i] = toks[j]
        return res
