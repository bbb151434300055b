"""Speculative decoding: proposers (n-gram lookup, a draft model), verification by the
target in one batched step, rejection sampling, the auto policy (speculator.py)."""
from __future__ import annotations

from typing import Any

from .config import SpeculativeConfig


def build_speculator(config: Any, engine: Any, model: Any, num_blocks: int) -> Any:
    """The engine's Speculator from `config.speculative_config`, or None."""
    cfg = SpeculativeConfig.parse(config.speculative_config)
    if cfg is None:
        return None
    from .speculator import Speculator

    draft = None
    if cfg.method == "draft_model":
        from .draft import DraftProposer, load_draft

        draft_model = load_draft(cfg, model, config.model, engine.dtype, config.max_model_len)
        draft = DraftProposer(draft_model, num_blocks, config.block_size)
    return Speculator(cfg, engine.block_manager, config.max_num_batched_tokens, engine.max_model_len,
                      draft, engine.sampler.generator)


def spec_tokens(config: Any) -> int:
    """k of `config.speculative_config` (0: no speculation), for the runner's verify graphs."""
    cfg = SpeculativeConfig.parse(config.speculative_config)
    return 0 if cfg is None else cfg.num_speculative_tokens
