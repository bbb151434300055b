"""How a decoder layer's weights are laid out and multiplied: one strategy per format.

`llama.py` writes the layer once over `LinearOps`; the loader picks the strategy
for the device and the kernels that exist there (`ops.select_ops`), and the
strategy's `pack` lays the weights out for its kernels. A layer asks for five
things: a norm, the qkv projection, RoPE, "project and add to the residual,
then norm" after attention, and the MLP with its residual add and the next
layer's norm. Strategies fuse across those seams where their kernels can
(gemm.c and oneDNN put adds and SiLU in GEMM epilogues, CUDA puts the add in
the norm), so the layer need not know which fusions exist.

CPU strategies, in the order `ops.select_ops` prefers them:
  GemmOps     workers/cpu_ops/gemm.c on tiled weights (AVX-512; bf16 also AVX512-BF16)
  OneDNNOps   oneDNN-packed weights; in bf16 with SiLU, gate*up and adds in epilogues
  TorchOps    F.linear on dense weights, HF's op order (also the base of the others)
  Int4Ops     small bf16 steps on GGUF Q4 weights (beside OneDNN/Torch, for <= N tokens)
CUDA: `cuda_ops.CudaOps` (cuBLAS GEMMs, Triton add+RMSNorm and SiLU*up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import cpu_ops
from .greedy_screen import GreedyScreen
from .rope import apply_rope

Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a weight pre-packed by `pack_weight` (oneDNN's blocked layout).

    Measured on this codebase's CPUs: same results, 1.2-1.8x faster than F.linear
    at 1-64 rows in bf16 and float32, never slower at prefill sizes."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 32)


def packed_linear_swish(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ w.T), the activation fused into the GEMM's epilogue."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "swish", [], "")


def packed_linear_then(x: torch.Tensor, w: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    """(x @ w.T) <op> other ('add' or 'mul'), fused into the GEMM's epilogue (no bias)."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, w, None, op)


@dataclass(slots=True)
class Int4Weight:
    """A 4-bit weight packed for torch's CPU int4 weight-only matmul (group 32).

    Only built from GGUF Q4_0/Q4_1 tensors, which it represents exactly, so it
    changes speed, not the model: at a few tokens per step it reads ~4x fewer
    bytes than bf16, and small-batch decode is bound by reading weights."""

    packed: torch.Tensor         # uint8 [N, K/2]
    scales_zeros: torch.Tensor   # [K/32, N, 2] in the activation dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, 32, self.scales_zeros)
        return y if bias is None else y + bias


class TorchOps:
    """Dense [out, in] weights through `self.linear` (F.linear), HF's op order.

    `cpu` (workers/cpu_ops, or None) supplies one-pass RMSNorm and in-place RoPE."""

    rows_independent = False  # a row's result may depend on the batch's size (BLAS picks kernels by M)

    def __init__(self, cfg, cpu: "cpu_ops.CpuOps | None" = None) -> None:
        self.cfg = cfg
        self.cpu = cpu if cpu is not None and cfg.head_dim <= 256 else None
        self.inter = cfg.intermediate_size
        self.linear: Callable[..., torch.Tensor] = F.linear
        eps, hsz, c = cfg.rms_norm_eps, (cfg.hidden_size,), self.cpu
        self.norm: Norm = (lambda x, w: c.rms_norm(x, w, eps)) if c is not None else \
            (lambda x, w: F.rms_norm(x, hsz, w, eps))

    def pack(self, model) -> None:
        """Lay `model`'s weights out for this strategy (once, after loading)."""

    def rope(self, positions: torch.Tensor, table: torch.Tensor, t: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """qkv -> its rotated q/k heads [T, nh + nkv, hd] for this step's positions."""
        cfg = self.cfg
        nh, nkv, hd, qk_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size + cfg.kv_size
        if self.cpu is None:
            rows = table.index_select(0, positions).unsqueeze(1)  # [T, 1, 2, 2, hd/2]
            return lambda qkv: apply_rope(qkv[:, :qk_size].view(t, nh + nkv, hd), rows)
        pos, c = positions.to(torch.int64).contiguous(), self.cpu
        # in place: qkv is this layer's own
        return lambda qkv: c.rope_(qkv[:, :qk_size].view(t, nh + nkv, hd), pos, table)

    def qkv(self, h: torch.Tensor, lw) -> torch.Tensor:
        return self.linear(h, lw.qkv, lw.qkv_bias)

    def o_add(self, o: torch.Tensor, lw, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(o, lw.o, lw.o_bias)

    def mlp_add(self, h: torch.Tensor, lw, x: torch.Tensor) -> torch.Tensor:
        gu = self.linear(h, lw.gate_up, None)
        return x + self.linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], lw.down, None)

    def o_add_norm(self, o: torch.Tensor, lw, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + o Wo^T + b, its post-attention norm)."""
        x = self.o_add(o, lw, x)
        return x, self.norm(x, lw.post_norm)

    def mlp_add_norm(self, h: torch.Tensor, lw, x: torch.Tensor, next_norm: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x + MLP(h), its norm by the next layer's input weight; None after the last layer)."""
        x = self.mlp_add(h, lw, x)
        return x, None if next_norm is None else self.norm(x, next_norm)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gu = [gate | up] rows (the LoRA layer's unfused MLP)."""
        return F.silu(gu[:, :self.inter]) * gu[:, self.inter:]

    def add_norm(self, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x + y, its norm by w; None without w): the LoRA layer's residual seam."""
        x = x + y
        return x, None if w is None else self.norm(x, w)

    def head(self, h: torch.Tensor, w) -> torch.Tensor:
        return self.linear(h, w, None)


class Int4Ops(TorchOps):
    """Steps of at most `max_tokens` rows on the layers' `int4` weights (qkv, o, gate_up, down)."""

    def qkv(self, h, lw):
        return lw.int4[0].linear(h, lw.qkv_bias)

    def o_add(self, o, lw, x):
        return x + lw.int4[1].linear(o, lw.o_bias)

    def mlp_add(self, h, lw, x):
        gu = lw.int4[2].linear(h, None)
        return x + lw.int4[3].linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], None)


class OneDNNOps(TorchOps):
    """Weights re-laid in oneDNN's blocked format (see `packed_linear`).

    With `fuse` (bf16 only), gate/up are split so that silu(gate) and its product
    with up happen in the GEMM epilogues, as do the residual adds: fewer passes over
    activations (measured: MLP block 1.19x faster at 1024 rows, 1.10x at 32). It
    rounds once where HF rounds twice, so only for bf16, where outputs differ from
    float32 by bf16 rounding anyway; float32 stays op-for-op HF."""

    def __init__(self, cfg, cpu=None, fuse: bool = False) -> None:
        super().__init__(cfg, cpu)
        self.fuse = fuse
        self.linear = packed_linear

    def pack(self, model) -> None:
        inter = self.inter
        for i, lw in enumerate(model.layers):
            if self.fuse:
                lw.gate = pack_weight(lw.gate_up[:inter].contiguous())
                lw.up = pack_weight(lw.gate_up[inter:].contiguous())
                lw.gate_up = None
                model.drop_weight(f"layer{i}_gate_up")
            for name in ("qkv", "o", "gate_up", "down"):
                if getattr(lw, name) is not None:
                    setattr(lw, name, pack_weight(getattr(lw, name)))
                model.drop_weight(f"layer{i}_{name}")
        head = pack_weight(model.lm_head)
        model.drop_weight("lm_head")
        model.lm_head = head

    def o_add(self, o, lw, x):
        if not self.fuse or lw.o_bias is not None:
            return x + packed_linear(o, lw.o, lw.o_bias)
        return packed_linear_then(o, lw.o, x, "add")

    def mlp_add(self, h, lw, x):
        if not self.fuse:
            return super().mlp_add(h, lw, x)
        then = packed_linear_then
        return then(then(h, lw.up, packed_linear_swish(h, lw.gate), "mul"), lw.down, x, "add")


class GemmOps(TorchOps):
    """Every matrix in gemm.c's tiles (it replaces oneDNN and the int4 path at every step
    size: measured faster from 1 to 1024 rows, see gemm.c); gate/up split so that silu and
    the product run in its epilogues, as do the residual adds and biases.

    In bf16 the epilogues round once where HF rounds twice (as the fused oneDNN path
    does). In float32 an add or multiply in the epilogue is exactly HF's separate op;
    SiLU there uses vexp.h's exp instead of torch's, which differs in the last bit or two
    (96% of outputs identical, at most 2 ulp, on random inputs) and saves a pass plus an
    OpenMP wake-up per layer: decode steps of 32 rows 1.04x faster; the HF parity tests
    hold. gemm.c's rows are independent, so the model may drop rows before the last
    layer's o projection and MLP (see `LlamaForCausalLM.forward`)."""

    rows_independent = True

    def __init__(self, cfg, cpu: "cpu_ops.CpuOps") -> None:
        super().__init__(cfg, cpu)
        self.gemm = cpu
        g = cpu
        self.linear = lambda x, w, b: g.gemm(x, w, b)

    def pack(self, model) -> None:
        inter = self.inter

        def pack(w):  # the loader may have built quantized tiles already
            return w if isinstance(w, cpu_ops.GemmWeight) else cpu_ops.GemmWeight.pack(w)

        for i, lw in enumerate(model.layers):
            lw.qkv, lw.o, lw.down = pack(lw.qkv), pack(lw.o), pack(lw.down)
            if lw.gate_up is not None:
                lw.gate, lw.up = pack(lw.gate_up[:inter]), pack(lw.gate_up[inter:])
            lw.gate_up, lw.int4 = None, None
            for name in ("qkv", "o", "gate_up", "down"):
                model.drop_weight(f"layer{i}_{name}")
            for j in range(4):
                model.drop_weight(f"layer{i}_int4_{j}_packed")
                model.drop_weight(f"layer{i}_int4_{j}_sz")
        dense = model.lm_head if isinstance(model.lm_head, torch.Tensor) else model.embed if model.tied else None
        head = pack(model.lm_head)
        model.drop_weight("lm_head")
        model.lm_head = head
        if dense is not None and model.dtype == torch.float32:
            model.greedy = GreedyScreen.build(self.gemm, dense.detach(), head if dense is not model.embed else None)

    def o_add(self, o, lw, x):
        return self.gemm.gemm(o, lw.o, lw.o_bias, x, cpu_ops.EPI_ADD)

    def mlp_add(self, h, lw, x):
        g = self.gemm
        act = g.gemm(h, lw.gate, None, None, cpu_ops.EPI_SILU)
        return g.gemm(g.gemm(h, lw.up, None, act, cpu_ops.EPI_MUL), lw.down, None, x, cpu_ops.EPI_ADD)

