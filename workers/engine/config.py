"""Engine configuration. Field names follow vLLM's flags where the concept is the same."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineConfig:
    model: str = "demo"                      # 'demo', a .gguf file, or an HF directory
    served_model_name: str | None = None     # defaults to the model's own name
    dtype: str = "auto"                      # auto | float32 | bfloat16 (auto: bf16 where the CPU has native bf16)
    max_model_len: int | None = None         # defaults to the model's max positions
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024       # per-step token budget (decodes + prefill chunks)
    kv_cache_memory_bytes: int = 1 << 30     # KV cache capacity, sets num_blocks
    enable_prefix_caching: bool = True
    seed: int = 0
    role: str = "both"                       # prefill | decode | both (P/D)
    kv_hold_ttl_s: float = 120.0             # P/D prefill: held blocks freed if not pulled by then
    num_threads: int | None = None           # torch intra-op threads; None = all cores
    kv_connector: Any = None                 # a kvyard.workers.engine.api.KVConnector, or None
    extra: dict[str, Any] = field(default_factory=dict)
