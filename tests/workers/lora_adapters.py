"""Random PEFT adapters for the LoRA tests and benches: saved by PEFT itself, so the files
are exactly what users bring."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base_model, out_dir: Path, specs: list[tuple[str, int, int, list[str], bool]],
                  std: float = 0.05, seed: int = 0):
    """A PeftModel over `base_model` holding one adapter per spec
    (name, rank, alpha, modules, rsLoRA), each saved to out_dir/name with non-trivial random A and B (PEFT initialises B to
    zero: such an adapter would change nothing)."""
    from peft import LoraConfig, get_peft_model

    model = None
    gen = torch.Generator().manual_seed(seed)
    for name, rank, alpha, modules, rslora in specs:
        conf = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM", use_rslora=rslora)
        if model is None:
            model = get_peft_model(base_model, conf, adapter_name=name)
        else:
            model.add_adapter(name, conf)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if f".lora_A.{name}." in pname or f".lora_B.{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        model.save_pretrained(str(out_dir / "_save"), selected_adapters=[name])
        saved = out_dir / "_save" / name if name != "default" else out_dir / "_save"
        saved.rename(out_dir / name)
    model.eval()
    return model



def write_peft_adapter(out: Path, cfg, rank: int = 4, alpha: int = 8, std: float = 0.1,
                       modules: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0) -> Path:
    """PEFT's files written directly (for server tests that need no HF model)."""
    from kvyard.bench._lora_files import write_adapter

    return write_adapter(out, cfg, rank=rank, alpha=alpha, std=std, modules=modules, seed=seed)
