"""The Llama-family decoder (Llama, SmolLM, Mistral-without-window, Qwen2) over paged KV.

Built for low per-layer overhead on CPU: q/k/v and gate/up are fused into one
matrix each at load time, RoPE is a table lookup, and `forward` walks plain
tensor tuples instead of calling submodules (no hook dispatch per op). The
final RMSNorm lives in `compute_logits`, so it runs only on the rows the
engine samples from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_ops
from ..attention import AttentionBackend, AttentionMetadata
from .config import ModelConfig
from .greedy_screen import GreedyScreen
from .rope import apply_rope


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


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor     # [H]
    qkv: torch.Tensor            # [q + 2 kv, H]; this and o/gate_up/down may be oneDNN- or gemm.c-packed
    qkv_bias: torch.Tensor | None
    o: torch.Tensor              # [H, q]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor      # [H]
    gate_up: torch.Tensor | None  # [2 I, H]; None once split into gate/up (bf16 fused path)
    down: torch.Tensor           # [H, I]
    int4: tuple[Int4Weight, Int4Weight, Int4Weight, Int4Weight] | None = None  # qkv, o, gate_up, down
    gate: torch.Tensor | None = None  # packed [I, H], with `up`, when `fused` (see LlamaForCausalLM.pack)
    up: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    fuse_epilogues = True  # see `pack`; False keeps HF's op order in bf16 too

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, rope: torch.Tensor,
                 backend: AttentionBackend, int4_max_tokens: int = 8, tied: bool = False) -> None:
        super().__init__()
        self.tied = tied  # the head's values are the embedding's (whatever form lm_head takes)
        self.greedy = None  # greedy_screen.GreedyScreen, once `pack` built one (float32 + bf16 GEMM)
        self.config = cfg
        self.embed = nn.Parameter(embed, requires_grad=False)
        # The head may be packed (an opaque oneDNN tensor): a plain attribute, not a parameter.
        self.lm_head = self.embed if lm_head is embed else lm_head
        self.final_norm = nn.Parameter(final_norm, requires_grad=False)
        self.register_buffer("rope", rope, persistent=False)
        # Registered so state_dict sees them until `pack` swaps in opaque oneDNN copies;
        # forward reads the LayerWeights directly.
        for i, lw in enumerate(layers):
            for name in LayerWeights.__slots__:
                t = getattr(lw, name)
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    self.register_parameter(f"layer{i}_{name}", nn.Parameter(t, requires_grad=False))
            for j, w4 in enumerate(lw.int4 or ()):
                self.register_buffer(f"layer{i}_int4_{j}_packed", w4.packed, persistent=False)
                self.register_buffer(f"layer{i}_int4_{j}_sz", w4.scales_zeros, persistent=False)
        self.layers = layers
        self.linear = F.linear  # packed_linear once `pack` has re-laid the matrices
        self.fused = False      # bf16 + packed: SiLU, the gate*up product and residual adds run in GEMM epilogues
        # Steps with at most this many tokens use the int4 weights where present
        # (measured: below ~8 rows the int4 kernel wins; above, packed bf16 GEMM does).
        self.int4_max_tokens = int4_max_tokens if all(lw.int4 for lw in layers) else 0
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        # RMSNorm and RoPE in one pass each (workers/cpu_ops), else torch's ops.
        self.ops = None
        self.gemm = None  # workers/cpu_ops/gemm.c for every linear layer, once `pack` has tiled the weights

    def use_cpu_ops(self, enable: bool = True) -> None:
        """Pick the C kernels; call before `pack`, which lays the weights out for the GEMM it finds."""
        ops = cpu_ops.load() if enable else None
        self.ops = ops if ops is not None and self.config.head_dim <= 256 else None
        if self.linear is F.linear:  # weights not packed yet
            self.gemm = ops if ops is not None and ops.has_gemm(self.dtype) else None

    def _norm_rope(self):
        """(norm(x, w), rope(qkv) -> (q, k)) for this step: the C ops in bf16 when built, else torch."""
        hsz, eps, ops = (self.config.hidden_size,), self.config.rms_norm_eps, self.ops
        if ops is None:
            return (lambda x, w: F.rms_norm(x, hsz, w, eps)), None
        return (lambda x, w: ops.rms_norm(x, w, eps)), ops

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def pack(self) -> None:
        """Re-lay the dense matrices in oneDNN's blocked format (see `packed_linear`).
        A tied head gets its own packed copy; the embedding table stays as is.

        In bf16, gate/up are also split so that silu(gate) and its product with up
        happen in the GEMM epilogues, as do the residual adds: fewer passes over
        activations (measured: MLP block 1.19x faster at 1024 rows, 1.10x at 32).
        It rounds once where HF rounds twice, so only for bf16, where outputs
        differ from float32 by bf16 rounding anyway; float32 stays op-for-op HF."""
        if self.linear is not F.linear:
            return
        if self.gemm is not None:
            self._pack_tiles()
            return
        if not torch.backends.mkldnn.is_available():
            return
        fuse = self.fuse_epilogues and self.dtype == torch.bfloat16
        inter = self.config.intermediate_size
        for i, lw in enumerate(self.layers):
            if fuse:
                lw.gate, lw.up = pack_weight(lw.gate_up[:inter].contiguous()), pack_weight(lw.gate_up[inter:].contiguous())
                lw.gate_up = None
                self._parameters.pop(f"layer{i}_gate_up", None)
            for name in ("qkv", "o", "gate_up", "down"):
                if getattr(lw, name) is not None:
                    setattr(lw, name, pack_weight(getattr(lw, name)))
                self._parameters.pop(f"layer{i}_{name}", None)
        self.fused = fuse
        head = pack_weight(self.lm_head)
        self._parameters.pop("lm_head", None)
        self.lm_head = head
        self.linear = packed_linear

    def _pack_tiles(self) -> None:
        """Every matrix into gemm.c's tiles (it replaces oneDNN and the int4 path at every
        step size: measured faster from 1 to 1024 rows, see gemm.c); gate/up split so
        that silu and the product run in its epilogues, as do the residual adds."""
        inter = self.config.intermediate_size

        def pack(w):  # the loader may have built quantized tiles already
            return w if isinstance(w, cpu_ops.GemmWeight) else cpu_ops.GemmWeight.pack(w)

        for i, lw in enumerate(self.layers):
            lw.qkv, lw.o, lw.down = pack(lw.qkv), pack(lw.o), pack(lw.down)
            if lw.gate_up is not None:
                lw.gate, lw.up = pack(lw.gate_up[:inter]), pack(lw.gate_up[inter:])
            lw.gate_up, lw.int4 = None, None
            for name in ("qkv", "o", "gate_up", "down"):
                self._parameters.pop(f"layer{i}_{name}", None)
            for j in range(4):
                self._buffers.pop(f"layer{i}_int4_{j}_packed", None)
                self._buffers.pop(f"layer{i}_int4_{j}_sz", None)
        self.int4_max_tokens = 0
        dense = self.lm_head if isinstance(self.lm_head, torch.Tensor) else self.embed if self.tied else None
        head = pack(self.lm_head)
        self._parameters.pop("lm_head", None)
        self.lm_head = head
        if dense is not None and self.dtype == torch.float32:
            self.greedy = GreedyScreen.build(self.gemm, dense.detach(), head if dense is not self.embed else None)
        gemm = self.gemm
        self.linear = lambda x, w, b: gemm.gemm(x, w, b)

    def _layers_tiled(self, x, kv_caches, meta, norm, rope, out_rows=None) -> torch.Tensor:
        """The decoder layers on gemm.c. In bf16 the epilogues round once where HF rounds
        twice (as the fused oneDNN path does). In float32 an add or multiply in the epilogue
        is exactly HF's separate op; SiLU there uses vexp.h's exp instead of torch's, which
        differs in the last bit or two (96% of outputs identical, at most 2 ulp, on random
        inputs) and saves a pass plus an OpenMP wake-up per layer: decode steps of 32 rows
        1.04x faster (same process, alternating); the HF parity tests hold.

        `out_rows`: after the last layer's attention (which every token's K/V and query
        still go through), only those rows go on through its o projection and MLP, 84% of
        a layer's weights: a 1,024-token prefill step that samples 4 rows skips a thirtieth
        of its GEMMs. Each row's arithmetic is the same either way (gemm.c's rows are
        independent), so the kept rows are bit-identical."""
        cfg, g = self.config, self.gemm
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_size, t, scale, attn = cfg.q_size + cfg.kv_size, x.shape[0], self.scale, self.backend.forward
        ADD, MUL, SILU = cpu_ops.EPI_ADD, cpu_ops.EPI_MUL, cpu_ops.EPI_SILU
        last = len(self.layers) - 1
        for i, (lw, cache) in enumerate(zip(self.layers, kv_caches)):
            qkv = g.gemm(norm(x, lw.input_norm), lw.qkv, lw.qkv_bias)
            qk = rope(qkv)
            o = attn(qk[:, :nh], qk[:, nh:], qkv[:, qk_size:].view(t, nkv, hd), cache, meta, scale)
            if i == last and out_rows is not None:
                if not out_rows.numel():  # a step that samples nothing (a prompt's middle chunk)
                    return x[:0]
                o, x = o[out_rows], x[out_rows]
            x = g.gemm(o.reshape(o.shape[0], -1), lw.o, lw.o_bias, x, ADD)
            h = norm(x, lw.post_norm)
            act = g.gemm(h, lw.gate, None, None, SILU)
            x = g.gemm(g.gemm(h, lw.up, None, act, MUL), lw.down, None, x, ADD)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the last layer, of every token or of `out_rows` (indices) only.
        Every token's K/V reaches the cache either way."""
        tiled = self.gemm is not None and self.linear is not F.linear
        if out_rows is not None and not tiled:
            return self.forward(input_ids, positions, kv_caches, meta)[out_rows]
        cfg = self.config
        hd, nh, nkv, hsz = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, (cfg.hidden_size,)
        qk_size = cfg.q_size + cfg.kv_size
        inter = cfg.intermediate_size
        eps, scale, attn = cfg.rms_norm_eps, self.scale, self.backend.forward
        t = input_ids.shape[0]
        norm, ops = self._norm_rope()
        if ops is None:
            rope_rows = self.rope.index_select(0, positions).unsqueeze(1)  # [T, 1, 2, 2, hd/2]

            def rope(qkv: torch.Tensor) -> torch.Tensor:
                return apply_rope(qkv[:, :qk_size].view(t, nh + nkv, hd), rope_rows)
        else:
            positions = positions.to(torch.int64).contiguous()

            def rope(qkv: torch.Tensor) -> torch.Tensor:  # in place: qkv is this layer's own
                return ops.rope_(qkv[:, :qk_size].view(t, nh + nkv, hd), positions, self.rope)
        x = F.embedding(input_ids, self.embed)
        if tiled:
            return self._layers_tiled(x, kv_caches, meta, norm, rope, out_rows)
        if t <= self.int4_max_tokens:
            for lw, cache in zip(self.layers, kv_caches):
                w_qkv, w_o, w_gu, w_down = lw.int4  # type: ignore[misc]
                h = norm(x, lw.input_norm)
                qkv = w_qkv.linear(h, lw.qkv_bias)
                qk = rope(qkv)
                o = attn(qk[:, :nh], qk[:, nh:], qkv[:, qk_size:].view(t, nkv, hd), cache, meta, scale)
                x = x + w_o.linear(o.reshape(t, -1), lw.o_bias)
                gu = w_gu.linear(norm(x, lw.post_norm), None)
                x = x + w_down.linear(F.silu(gu[:, :inter]) * gu[:, inter:], None)
            return x
        lin = self.linear
        if self.fused:
            then = packed_linear_then
            for lw, cache in zip(self.layers, kv_caches):
                h = norm(x, lw.input_norm)
                qkv = lin(h, lw.qkv, lw.qkv_bias)
                qk = rope(qkv)
                o = attn(qk[:, :nh], qk[:, nh:], qkv[:, qk_size:].view(t, nkv, hd), cache, meta, scale)
                o = o.reshape(t, -1)
                x = then(o, lw.o, x, "add") if lw.o_bias is None else x + lin(o, lw.o, lw.o_bias)
                h = norm(x, lw.post_norm)
                x = then(then(h, lw.up, packed_linear_swish(h, lw.gate), "mul"), lw.down, x, "add")
            return x
        for lw, cache in zip(self.layers, kv_caches):
            h = norm(x, lw.input_norm)
            qkv = lin(h, lw.qkv, lw.qkv_bias)
            qk = rope(qkv)
            o = attn(qk[:, :nh], qk[:, nh:], qkv[:, qk_size:].view(t, nkv, hd), cache, meta, scale)
            x = x + lin(o.reshape(t, -1), lw.o, lw.o_bias)
            gu = lin(norm(x, lw.post_norm), lw.gate_up, None)
            x = x + lin(F.silu(gu[:, :inter]) * gu[:, inter:], lw.down, None)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the sampled rows only; float32 for the sampler."""
        return self._head(self._normed(hidden))

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden, (self.config.hidden_size,), self.final_norm, self.config.rms_norm_eps)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h, self.lm_head, None).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1), the same tokens (first maximum), through the
        bf16 screen where the model has one (float32, see greedy_screen.py)."""
        if self.greedy is None:
            return self.compute_logits(hidden).argmax(dim=-1)
        h = self._normed(hidden).contiguous()
        tokens = self.greedy.tokens(h)
        redo = (tokens < 0).nonzero().flatten()
        if redo.numel():
            tokens[redo] = self._head(h[redo]).argmax(dim=-1)
        return tokens
