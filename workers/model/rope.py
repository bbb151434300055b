"""Rotary embeddings precomputed once, so a step only indexes a table by position.

The table stores, per position, `cos` repeated over both halves and `sin`
signed as [-sin, +sin]; with it HF's rotate-half RoPE becomes
`x * cos + swap_halves(x) * sin`, three tensor ops for q and k together.
Frequencies follow transformers' float32 arithmetic so logits match it.
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc["rope_type"]
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: llama.cpp divides each frequency by it
        if freq_factors is None:
            raise ValueError("rope_type freq_factors needs the rope_freqs tensor")
        return inv / freq_factors.float()
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def rope_table(cfg: ModelConfig, max_len: int, dtype: torch.dtype,
               freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[max_len, 2, 2, head_dim/2]: [:, 0] = (cos, cos), [:, 1] = (-sin, +sin)."""
    inv = inv_frequencies(cfg, freq_factors)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    table = torch.stack((torch.stack((cos, cos), 1), torch.stack((-sin, sin), 1)), 1)
    return table.to(dtype).contiguous()


def apply_rope(qk: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
    """Rotate q and k heads at once. qk: [T, heads, head_dim] (any row stride);
    table_rows: [T, 1, 2, 2, half] rows of `rope_table` for the tokens' positions."""
    t, h, d = qk.shape
    x = qk.unflatten(-1, (2, d // 2))
    return torch.addcmul(x * table_rows[:, :, 0], x.flip(2), table_rows[:, :, 1]).view(t, h, d)
