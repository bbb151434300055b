"""The decoder layer's seams with LoRA deltas added, over any linear-ops strategy.

Strategies fuse the o projection with the residual add and the whole MLP into
epilogues (linear_ops.py, cuda_ops.py), which leaves no place for a delta; in a step
whose batch has adapters the projections run apart through the strategy's own `linear`
on its own weight layout, in PEFT's order (base + delta, then the residual), and the
elementwise rest through its `silu_mul` and `add_norm` (on CUDA one kernel each, as in
the fused path). Steps without adapters never come here.
"""
from __future__ import annotations

import torch

from .batch import LoRABatch


def _linear(ops, x: torch.Tensor, w, bias=None) -> torch.Tensor:
    return ops.linear(x, w, bias)


def o_add_norm(ops, lora: LoRABatch, i: int, o: torch.Tensor, lw, x: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    if "o" not in lora.projs:
        return ops.o_add_norm(o, lw, x)
    y = _linear(ops, o, lw.o, lw.o_bias)
    lora.apply(i, "o", o, y)
    return ops.add_norm(y, x, lw.post_norm)


def mlp_add_norm(ops, lora: LoRABatch, i: int, h: torch.Tensor, lw, x: torch.Tensor,
                 next_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not lora.projs & {"gate_up", "down"}:
        return ops.mlp_add_norm(h, lw, x, next_norm)
    if not isinstance(h, torch.Tensor):
        h = h.materialize()   # a pending norm (cuda_ops.PendingNorm) from the strategy's o_add_norm
    if lw.gate_up is not None:
        gu = _linear(ops, h, lw.gate_up)
    else:  # strategies that split gate/up for their epilogues
        gu = torch.cat([_linear(ops, h, lw.gate), _linear(ops, h, lw.up)], dim=1)
    lora.apply(i, "gate_up", h, gu)
    act = ops.silu_mul(gu)
    y = _linear(ops, act, lw.down)
    lora.apply(i, "down", act, y)
    return ops.add_norm(y, x, next_norm)
