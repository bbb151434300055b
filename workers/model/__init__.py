"""The Llama-family model and its loaders (GGUF file or Hugging Face directory).

Public contract used by the engine: `ModelConfig`, `load_model`, `kv_cache_shape`;
the loaded module has `forward(input_ids, positions, kv_caches, meta) -> hidden`
and `compute_logits(hidden_rows) -> float32 logits` (the final norm runs there).

Modules: `config` (ModelConfig from config.json or GGUF metadata), `gguf_file`
(fast GGUF reader and torch dequantisers), `loader` (weight sources, fusing,
packing), `llama` (the decoder), `rope` (RoPE tables incl. llama3 scaling),
`bench_step` (decode-step timing: `python -m kvyard.workers.model.bench_step`).
"""
from .config import ModelConfig
from .loader import kv_cache_shape, load_model

__all__ = ["ModelConfig", "load_model", "kv_cache_shape"]
