"""Engine configuration. Field names follow vLLM's flags where the concept is the same."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineConfig:
    model: str = "demo"                      # 'demo', a .gguf file, or an HF directory
    served_model_name: str | None = None     # defaults to the model's own name
    dtype: str = "auto"                      # auto | float32 | bfloat16 (auto: bf16 on CUDA and where the CPU has native bf16)
    device: str = "auto"                     # auto | cpu | cuda (auto: CUDA when torch sees a GPU)
    gpu_memory_utilization: float = 0.9      # CUDA: the card's share weights + KV cache + activations may take
    enforce_eager: bool = False              # CUDA: no CUDA graphs for decode steps
    max_model_len: int | None = None         # defaults to the model's max positions
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024       # per-step token budget (decodes + prefill chunks)
    kv_cache_memory_bytes: int | None = None  # KV cache capacity, sets num_blocks; None: CPU 1 GiB,
                                             # CUDA gpu_memory_utilization of the card less what is in use
    kv_cache_dtype: str = "auto"             # auto (the model's dtype) | int8 | fp8 | fp8_e4m3 (GPU)
    enable_prefix_caching: bool = True
    seed: int = 0
    role: str = "both"                       # prefill | decode | both (P/D)
    kv_hold_ttl_s: float = 120.0             # P/D prefill: held blocks freed if not pulled by then
    num_threads: int | None = None           # torch intra-op threads; None = all cores
    quantization: str | None = None          # weights: None (as stored) | int8 | fp8 | int4 | gguf (docs/quantization.md)
    kv_connector: Any = None                 # a kvyard.workers.engine.api.KVConnector, or None
    lora: Any = None                         # a kvyard.workers.lora.config.LoRAConfig (--enable-lora), or None
    speculative_config: dict | None = None   # vLLM's --speculative-config (engine/spec/config.py)
    extra: dict[str, Any] = field(default_factory=dict)


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """`kvyard worker`'s device flags, vLLM's names."""
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (auto: CUDA when present)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the card's share for weights, KV cache and activations")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")


def device_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"device": args.device, "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": args.enforce_eager}
