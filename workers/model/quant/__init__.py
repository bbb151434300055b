"""Weight quantization applied at load time (`--quantization`, vLLM's flag).

`formats.py` turns a dense [N, K] matrix into codes and scales (int8 per channel,
fp8 E4M3 per channel, int4 group-wise) in the block form `cpu_ops.GemmWeight.pack_quant`
lays out for gemm.c (gemm_quant.h expands them per tile) and, on CUDA, `cuda_quant.py`
multiplies (Triton dequant-GEMM for int8/int4, `torch._scaled_mm` for fp8 on Hopper).
See docs/quantization.md.
"""
from .formats import METHODS, QuantParts, dequantize, quantize, validate_method

__all__ = ["METHODS", "QuantParts", "dequantize", "quantize", "validate_method"]
