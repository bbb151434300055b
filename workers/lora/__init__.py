"""Multi-LoRA serving: PEFT adapters over the engine's fused projections.

`adapter.py` reads PEFT's format into per-projection (A, B) pairs laid out for the
fused q/k/v and gate/up matrices; `config.py` holds vLLM's flags; `manager.py` keeps
the adapters (the registry of served names, an LRU of loaded weights in host memory
bounded by --max-cpu-loras, and --max-loras device slots of stacked weights);
`batch.py` is one step's row-to-slot mapping and the batched shrink/expand per
projection (`cpu_ops/lora.c` on the CPU, `triton_lora.py` on CUDA); `layer.py` adds the deltas
inside the decoder layer. The engine touches this package only through
`build_manager`, `LoRABatch` and `layer`.
"""
