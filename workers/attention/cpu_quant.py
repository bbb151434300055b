"""ctypes entry points of the quantized-KV C kernels (cpu_ops/paged_attention_q8.h), bound
from the library cpu_ops builds: the KV write (quantize into the slots) and paged
attention that dequantizes as it reads."""
from __future__ import annotations

import ctypes

import torch

from .. import cpu_ops
from .kv_quant import format_of

_Q_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class QuantKernels:
    def __init__(self, ops: cpu_ops.CpuOps) -> None:
        lib = ctypes.CDLL(str(ops.path))
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        self._write = lib.kv_write_q8
        self._write.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32]
        self._write.restype = i32
        self._attend = lib.paged_attention_q8
        self._attend.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32,
                                 f32, i32, i32, i32, i32]
        self._attend.restype = i32
        self.isa = ops.isa

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _Q_DTYPES

    def write(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """kv_quant.write, in C (bit-identical)."""
        T, nkv, hd = k.shape
        if k.dtype not in _Q_DTYPES or v.dtype != k.dtype or k.stride(2) != 1 or v.stride(2) != 1 \
                or not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64 \
                or not slot_mapping.is_contiguous() or kv_cache.shape[-1] != hd + 4:
            raise ValueError("quantized KV write: unexpected layout")
        rc = self._write(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                         kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), slot_mapping.data_ptr(), T, nkv, hd,
                         _Q_DTYPES[k.dtype], format_of(kv_cache).code)
        if rc != 0:
            raise RuntimeError(f"quantized KV write failed ({rc})")

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               q_rows: torch.Tensor, q_lens: torch.Tensor, max_len: int, scale: float,
               out: torch.Tensor) -> torch.Tensor:
        """cpu_ops.CpuOps.attend over a quantized cache."""
        nq, nh, hd = q.shape
        _, _, bs, nkv, w = kv_cache.shape
        if q.stride(2) != 1 or not kv_cache.is_contiguous() or not out.is_contiguous() or w != hd + 4 \
                or block_tables.dtype != torch.int64 or block_tables.stride(1) != 1 \
                or q_rows.dtype != torch.int32 or q_lens.dtype != torch.int32 \
                or not q_rows.is_contiguous() or not q_lens.is_contiguous() or out.dtype != q.dtype:
            raise ValueError("quantized attention kernel: unexpected layout")
        rc = self._attend(q.data_ptr(), q.stride(0), q.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                          block_tables.data_ptr(), block_tables.stride(0), q_rows.data_ptr(), q_lens.data_ptr(),
                          out.data_ptr(), nq, nh, nkv, hd, bs, scale, max_len, torch.get_num_threads(),
                          _Q_DTYPES[q.dtype], format_of(kv_cache).code)
        if rc != 0:
            raise RuntimeError(f"quantized attention kernel failed ({rc})")
        return out


def load(portable: bool = False) -> QuantKernels | None:
    """The kernels of cpu_ops.load(portable), None where that library is unavailable."""
    ops = cpu_ops.load(portable)
    return None if ops is None else QuantKernels(ops)
