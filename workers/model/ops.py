"""Which linear-ops strategy a model runs with: above both `linear_ops` (the CPU
strategies) and `cuda_ops` (the CUDA one, built on `TorchOps`), so neither imports
the other's module back."""
from __future__ import annotations

import torch

from .. import cpu_ops
from .linear_ops import GemmOps, OneDNNOps, TorchOps


def select_ops(cfg, dtype: torch.dtype, device: torch.device, cpu_kernels: bool = True,
               fuse_epilogues: bool = True) -> TorchOps:
    """The strategy for `device` and the kernels that build here (the order is
    `linear_ops`'s module doc). CUDA's is imported only for a CUDA device: it needs
    Triton, which a CPU-only install lacks."""
    if device.type == "cuda":
        from .cuda_ops import CudaOps

        return CudaOps(cfg)
    cpu = cpu_ops.load() if cpu_kernels else None
    if cpu is not None and cpu.has_gemm(dtype):
        return GemmOps(cfg, cpu)
    if torch.backends.mkldnn.is_available():
        return OneDNNOps(cfg, cpu, fuse=fuse_epilogues and dtype == torch.bfloat16)
    return TorchOps(cfg, cpu)
