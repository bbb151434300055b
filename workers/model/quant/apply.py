"""One linear layer's matrix in the format `--quantization` asks for, on the model's device.

CPU with gemm.c (AVX-512): quantized 64-column tiles (`GemmWeight.pack_quant`), expanded
per tile inside the GEMM for float32 and bf16 activations. CUDA: `cuda_quant.QuantWeight`.
CPU without gemm.c: the documented fallback, the quantized values dequantized back to a
dense matrix in the activation dtype: the accuracy of the format, none of its speed.
"""
from __future__ import annotations

import torch

from ... import cpu_ops
from .formats import QuantParts, dequantize, quantize


TARGETS = ("tiles", "cuda", "dense")  # gemm.c tiles | cuda_quant.QuantWeight | the fallback


def target_for(ops) -> str:
    """Where a strategy's quantized matrices go: gemm.c's tiles, CUDA kernels (CudaOps, on
    any device: tests run it on CPU under TRITON_INTERPRET=1), else dense."""
    from ..linear_ops import GemmOps

    return "tiles" if isinstance(ops, GemmOps) else "cuda" if hasattr(ops, "rope_in_attention") else "dense"


def quantized_matrix(parts: list[torch.Tensor], method: str, dtype: torch.dtype,
                     device: torch.device | str, target: str):
    """Rows of `parts` fused, quantized with `method` (int8 | fp8 | int4), laid out for `target`."""
    w = parts[0] if len(parts) == 1 else torch.cat(parts)
    return place(quantize(w, method), dtype, device, target)


def place(q: QuantParts, dtype: torch.dtype, device: torch.device | str, target: str):
    if target == "tiles":
        return cpu_ops.GemmWeight.pack_quant(q.codes, q.d, q.m, q.bits, 0.0, dtype)
    if target == "cuda":
        from .cuda_quant import QuantWeight

        return QuantWeight.build(q, torch.device(device))
    return dequantize(q).to(device=device, dtype=dtype)


def weight_bytes(w) -> int:
    """Bytes a layer's matrix occupies as laid out (dense, tiles or CUDA parts)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if isinstance(w, cpu_ops.GemmWeight):
        return w.packed.numel() * w.packed.element_size()
    return w.nbytes
