"""The Llama-family model and its loaders (GGUF file or Hugging Face directory).

Public contract used by the engine: `ModelConfig`, `load_model`, `kv_cache_shape`;
the loaded module has `forward(input_ids, positions, kv_caches, meta) -> hidden`
and `compute_logits(hidden_rows) -> float32 logits`.
"""
from .config import ModelConfig
from .loader import kv_cache_shape, load_model

__all__ = ["ModelConfig", "load_model", "kv_cache_shape"]
