"""Random PEFT-format adapters for the LoRA benches (PEFT's file layout and key names)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, cfg, rank: int = 16, alpha: int = 16, std: float = 0.05,
                  modules: tuple[str, ...] = MODULES, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    from kvyard.workers.lora.adapter import MODULE_PROJ, projection_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(cfg)
    tensors = {}
    for i in range(cfg.num_layers):
        for m in modules:
            proj, j = MODULE_PROJ[m]
            fan_in, slices = shapes[proj]
            part = "self_attn" if proj in ("qkv", "o") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(slices[j][1], rank, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
         "bias": "none", "task_type": "CAUSAL_LM"}))
    return out
