"""The workers' CPU kernels in C: paged attention (paged_attention.c), bf16
RMSNorm and RoPE (norm_rope.c), the linear layers' GEMM (gemm.c) and the batched
LoRA step (lora.c). This module builds and loads them.

Why C through ctypes rather than a torch C++ extension: the kernels need no
torch headers (it works on raw pointers), so it compiles in about a second
with the system compiler instead of a minute, and a missing compiler only
costs speed: `load()` returns None and callers keep their torch paths.

The library is built once per (source, compiler, CPU flags) into
`$KVYARD_CACHE_DIR/kernels` (default ~/.cache/kvyard/kernels) with
`-march=native`, so each machine gets code for its own vector units; several
workers starting at once build into temp files and rename atomically.
Threads come from pool.c's own team (helpers that poll briefly between
calls, then sleep), not OpenMP: see pool.c for the measured reason. Callers
pass torch.get_num_threads(), so one setting governs torch and the kernels.
`KVYARD_CPU_KERNELS=0` turns them all off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .lora_args import LoraGroups, LoraWeights

log = logging.getLogger(__name__)

_SRCS = [Path(__file__).with_name(n)
         for n in ("paged_attention.c", "norm_rope.c", "gemm.c", "greedy.c", "lora.c", "pool.c")]

# gemm.c's epilogues, applied to the float32 result before it is stored.
EPI_NONE, EPI_ADD, EPI_MUL, EPI_SILU = 0, 1, 2, 3
_EPI_OUT_F32 = 16  # bf16 operands, float32 output
_GEMM_TILE = 64


@dataclass(slots=True)
class GemmWeight:
    """A [N, K] matrix in gemm.c's tile layout: N padded to whole 64-column tiles;
    bf16 as [N/64][K/2][64][2] (k pairs, the vdpbf16ps operand), float32 as [N/64][K][64];
    or (bits 4/8) GGUF 32-blocks per tile, expanded on the fly (gemm_quant.h)."""

    packed: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype | None = None  # the activations' dtype; None: packed's own
    bits: int = 0
    offset: float = 0.0

    @classmethod
    def pack_quant(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, offset: float,
                   dtype: torch.dtype) -> "GemmWeight":
        """From `kvyard.workers.model.gguf_file.quant_parts` (rows may be fused or permuted first)."""
        n, k = codes.shape
        kb, t = k // 32, -(-n // _GEMM_TILE)
        pad = t * _GEMM_TILE - n

        def tiles(a: torch.Tensor) -> torch.Tensor:  # [N, X] -> [T, 64, X], zero rows as padding
            return torch.cat((a, a.new_zeros(pad, a.shape[1]))).view(t, _GEMM_TILE, a.shape[1])

        scale = tiles(d.to(torch.float16)).permute(0, 2, 1).contiguous().view(torch.uint8)  # [T, KB, 128]
        mins = tiles(m.to(torch.float16)).permute(0, 2, 1).contiguous().view(torch.uint8)
        c = tiles(codes.view(torch.uint8)).view(t, _GEMM_TILE, kb, 32).permute(0, 2, 3, 1)  # [T, KB, 32 k, 64 cols]
        if bits == 4:
            c = c[..., :32] | (c[..., 32:] << 4)
        packed = torch.cat((scale, mins, c.reshape(t, kb, -1)), dim=2).contiguous()
        return cls(packed, n, k, dtype, bits, offset)

    @classmethod
    def pack(cls, w: torch.Tensor) -> "GemmWeight":
        n, k = w.shape
        n_pad = -(-n // _GEMM_TILE) * _GEMM_TILE
        wp = torch.zeros(n_pad, k, dtype=w.dtype)
        wp[:n] = w
        if w.dtype == torch.bfloat16:
            if k % 2:
                raise ValueError("bf16 GEMM weights need an even K")
            packed = wp.view(n_pad // _GEMM_TILE, _GEMM_TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            packed = wp.view(n_pad // _GEMM_TILE, _GEMM_TILE, k).permute(0, 2, 1).contiguous()
        return cls(packed, n, k)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-fPIC", "-shared", "-std=gnu11", "-Wall"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("KVYARD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvyard")
    return Path(base) / "kernels"


def _build(cc: str, portable: bool) -> Path:
    headers = sorted(_SRCS[0].parent.glob("*.h"))
    src = b"\0".join(p.read_bytes() for p in (*_SRCS, *headers))
    flags = _FLAGS + (["-mno-avx512f"] if portable else [])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    out = _cache_dir() / f"cpu_ops-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, *map(str, _SRCS), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class CpuOps:
    """Typed entry points of the built library."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_float, ctypes.c_int, ctypes.c_int]
        self._fns = {}
        for dtype, name in ((torch.bfloat16, "paged_attention_bf16"), (torch.float32, "paged_attention_f32")):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._fns[dtype] = fn
        self.path = path
        lib.paged_attention_isa.restype = ctypes.c_int
        isa = lib.paged_attention_isa()
        self.isa = "+".join(n for bit, n in ((1, "avx512"), (2, "avx512bf16")) if isa & bit) or "portable"
        norm_args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        rope_args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._norm, self._rope = {}, {}
        for dtype, sfx in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            for table, name, args in ((self._norm, "rms_norm_", norm_args), (self._rope, "rope_", rope_args)):
                fn = getattr(lib, name + sfx)
                fn.argtypes, fn.restype = args, None
                table[dtype] = fn
        gemm_args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                     ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        self._gemm = {}
        for dtype, name, need in ((torch.bfloat16, "gemm_bf16", 3), (torch.float32, "gemm_f32", 1)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = gemm_args, ctypes.c_int
            if isa & need == need:
                self._gemm[dtype] = fn
        lib.greedy_refine.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.greedy_refine.restype = ctypes.c_int
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.lora_sgmv.argtypes = [p, i64, p, i64, p, p, p, i32, i32, i32, i32, p, p, p, p, p, i64, i32, i32, i32]
        lib.lora_sgmv.restype = ctypes.c_int
        self._lib = lib

    def has_gemm(self, dtype: torch.dtype) -> bool:
        """Whether gemm.c has a fast path for `dtype` here (AVX-512; bf16 also needs AVX512-BF16)."""
        return dtype in self._gemm

    def gemm(self, x: torch.Tensor, w: GemmWeight, bias: torch.Tensor | None = None,
             other: torch.Tensor | None = None, epi: int = EPI_NONE, out_f32: bool = False) -> torch.Tensor:
        """epi(x @ W^T + bias) for rows x [M, K] (unit inner stride), with `other` [M, N]
        the operand of EPI_ADD / EPI_MUL; x's dtype throughout (the output float32 with
        `out_f32`), float32 accumulation."""
        m, k = x.shape
        if k != w.k or x.stride(1) != 1 or x.dtype != (w.dtype or w.packed.dtype) \
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())) \
                or ((other is None) != (epi in (EPI_NONE, EPI_SILU))) \
                or (other is not None and (other.dtype != x.dtype or other.stride(1) != 1
                                           or tuple(other.shape) != (m, w.n))):
            raise ValueError("gemm: unexpected operands")
        out = torch.empty(m, w.n, dtype=torch.float32 if out_f32 else x.dtype)
        if m == 0:
            return out
        rc = self._gemm[x.dtype](x.data_ptr(), x.stride(0), w.packed.data_ptr(), out.data_ptr(), out.stride(0),
                                 None if bias is None else bias.data_ptr(),
                                 None if other is None else other.data_ptr(),
                                 0 if other is None else other.stride(0), m, w.n, k,
                                 epi | (_EPI_OUT_F32 if out_f32 else 0), w.bits, w.offset,
                                 torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"gemm kernel failed ({rc})")
        return out

    def greedy_refine(self, x: torch.Tensor, xb: torch.Tensor, scores: torch.Tensor, wn: torch.Tensor,
                      dn: torch.Tensor, w: torch.Tensor, strides: tuple[int, int, int]) -> torch.Tensor:
        """greedy.c: per row of x [n, K] float32, the argmax of its float32 logits against
        head w (element (v, k) at w[(v // 64) * ts + (v % 64) * rs + k * ks], `strides` =
        (ts, rs, ks)), from the bf16 screen `scores` [n, V] of the rows xb (x in bf16) and
        the per-token norms wn, dn [V] of the bound; -1 where the row needs the full GEMM."""
        n, k = x.shape
        v = scores.shape[1]
        if x.dtype != torch.float32 or x.stride(1) != 1 or xb.dtype != torch.bfloat16 or xb.shape != x.shape \
                or xb.stride(1) != 1 or scores.dtype != torch.float32 or scores.stride(1) != 1 \
                or scores.shape[0] != n or wn.shape != (v,) or dn.shape != (v,) or w.dtype != torch.float32 \
                or not (wn.is_contiguous() and dn.is_contiguous() and w.is_contiguous()) \
                or (v - 1) // 64 * strides[0] + (v - 1) % 64 * strides[1] + (k - 1) * strides[2] >= w.numel():
            raise ValueError("greedy_refine: unexpected operands")
        out = torch.empty(n, dtype=torch.int64)
        rc = self._lib.greedy_refine(x.data_ptr(), x.stride(0), scores.data_ptr(), scores.stride(0),
                                     wn.data_ptr(), dn.data_ptr(), xb.data_ptr(), xb.stride(0), w.data_ptr(),
                                     *strides, n, v, k, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"greedy_refine failed ({rc})")
        return out

    def lora_sgmv(self, x: torch.Tensor, y: torch.Tensor, w: LoraWeights, g: LoraGroups) -> None:
        """lora.c, one projection for every adapter group of a step, in place:
        y[r] += (x[r] @ A[s]^T) @ B[s]^T for the rows r of each group (slot s).
        x [T, K] and y [T, N] with unit inner stride, in the weights' dtype."""
        if x.dtype != w.dtype or y.dtype != w.dtype or x.shape != (g.num_rows, w.args[3]) \
                or y.shape != (g.num_rows, w.args[5]) or x.stride(1) != 1 or y.stride(1) != 1 \
                or g.mid.shape[1] < w.args[4]:
            raise ValueError("lora_sgmv: unexpected operands")
        rc = self._lib.lora_sgmv(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), *w.args, *g.args,
                                 x.dtype == torch.bfloat16, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"lora_sgmv failed ({rc})")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's LlamaRMSNorm of bf16 or float32 rows x ([T, H], unit inner stride) in one pass."""
        if x.dtype not in self._norm or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous() \
                or weight.dtype != x.dtype:
            raise ValueError("rms_norm: bf16 or float32 [T, H] rows expected")
        out = torch.empty(x.shape, dtype=x.dtype)
        self._norm[x.dtype](x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                                x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out

    def rope_(self, qk: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rotate qk ([T, heads, head_dim], bf16 or float32, heads contiguous in a row) in place
        by the rows of `table` (workers/model/rope.py's layout) at `positions` (int64)."""
        t, h, d = qk.shape
        if qk.dtype not in self._rope or table.dtype != qk.dtype or qk.stride(2) != 1 \
                or qk.stride(1) != d or d > 256 or d % 2 or positions.dtype != torch.int64 \
                or not positions.is_contiguous() or not table.is_contiguous():
            raise ValueError("rope_: unexpected layout")
        self._rope[qk.dtype](qk.data_ptr(), qk.stride(0), t, h, d, positions.data_ptr(), table.data_ptr(),
                            torch.get_num_threads())
        return qk

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               q_rows: torch.Tensor, q_lens: torch.Tensor, max_len: int, scale: float,
               out: torch.Tensor) -> torch.Tensor:
        """out[i] = attention of query i (q[i]: [num_heads, head_dim], any token stride) over
        the first q_lens[i] slots of block_tables[q_rows[i]]. Tables int64 row-major;
        q_rows, q_lens int32; max_len >= every q_lens[i]."""
        nq, nh, hd = q.shape
        _, _, bs, nkv, _ = kv_cache.shape
        if q.stride(2) != 1 or not kv_cache.is_contiguous() or not out.is_contiguous() \
                or block_tables.dtype != torch.int64 or block_tables.stride(1) != 1 \
                or q_rows.dtype != torch.int32 or q_lens.dtype != torch.int32 \
                or not q_rows.is_contiguous() or not q_lens.is_contiguous() or out.dtype != q.dtype:
            raise ValueError("attention kernel: unexpected layout")
        rc = self._fns[q.dtype](
            q.data_ptr(), q.stride(0), q.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), q_rows.data_ptr(), q_lens.data_ptr(),
            out.data_ptr(), nq, nh, nkv, hd, bs, scale, max_len, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"attention kernel failed ({rc})")
        return out


@functools.cache
def load(portable: bool = False) -> CpuOps | None:
    """The kernel for this machine, built if needed (once per process); None if
    disabled or unbuildable. `portable` builds without AVX-512 (tests check
    that path too)."""
    kernel = None
    if os.environ.get("KVYARD_CPU_KERNELS", "1") != "0":
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            log.warning("no C compiler found: decode attention uses the slower torch path")
        else:
            try:
                kernel = CpuOps(_build(cc, portable))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.warning("decode kernel unavailable, using the torch path: %s", e)
    return kernel
