"""The Llama-family decoder (Llama, SmolLM, Mistral-without-window, Qwen2) over paged KV.

Built for low per-layer overhead: q/k/v and gate/up are fused into one matrix
each at load time, RoPE is a table lookup, and `forward` walks plain tensor
tuples instead of calling submodules (no hook dispatch per op). The layer is
written once, over the linear-ops strategy the loader picked for the device
(linear_ops.py: gemm.c, oneDNN, torch, int4 for small steps; cuda_ops.py).
The final RMSNorm lives in `compute_logits`, so it runs only on the rows the
engine samples from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from ..lora import layer as lora_layer
from .config import ModelConfig
from .linear_ops import GemmOps, Int4Ops, Int4Weight, TorchOps
from .ops import select_ops

__all__ = ["Int4Weight", "LayerWeights", "LlamaForCausalLM"]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor     # [H]
    qkv: torch.Tensor            # [q + 2 kv, H]; this and o/gate_up/down may be packed by the ops strategy
    qkv_bias: torch.Tensor | None
    o: torch.Tensor              # [H, q]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor      # [H]
    gate_up: torch.Tensor | None  # [2 I, H]; None once split into gate/up (strategies with epilogues)
    down: torch.Tensor           # [H, I]
    int4: tuple[Int4Weight, Int4Weight, Int4Weight, Int4Weight] | None = None  # qkv, o, gate_up, down
    gate: torch.Tensor | None = None  # [I, H], with `up`, when the strategy split gate_up
    up: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, rope: torch.Tensor,
                 backend: AttentionBackend, int4_max_tokens: int = 8, tied: bool = False,
                 ops: TorchOps | None = None) -> None:
        """`ops`: the linear-ops strategy (default: `select_ops` for the weights' device);
        its `pack` re-lays the weights here, once."""
        super().__init__()
        self.tied = tied  # the head's values are the embedding's (whatever form lm_head takes)
        self.greedy = None  # greedy_screen.GreedyScreen, when the strategy built one (float32 + bf16 GEMM)
        self.config = cfg
        self.embed = nn.Parameter(embed, requires_grad=False)
        # The head may be packed (an opaque tensor): a plain attribute, not a parameter.
        self.lm_head = self.embed if lm_head is embed else lm_head
        self.final_norm = nn.Parameter(final_norm, requires_grad=False)
        self.register_buffer("rope", rope, persistent=False)
        # Registered so state_dict sees them until a strategy swaps in packed copies;
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
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.ops = ops if ops is not None else select_ops(cfg, embed.dtype, embed.device)
        if getattr(self.ops, "rope_in_attention", False) and getattr(backend, "rope", None) is None:
            raise ValueError("these ops leave RoPE to the attention backend, which has no RoPE tables")
        # Steps with at most this many tokens use the int4 weights where present
        # (measured: below ~8 rows the int4 kernel wins; above, packed bf16 GEMM does).
        # GemmOps serves every step size faster, and drops them.
        have_int4 = all(lw.int4 for lw in layers) and not isinstance(self.ops, GemmOps)
        self.int4_max_tokens = int4_max_tokens if have_int4 else 0
        self.small_ops = Int4Ops(cfg, self.ops.cpu) if have_int4 else None
        self.ops.pack(self)

    def drop_weight(self, name: str) -> None:
        """Forget a registered parameter or buffer once a strategy replaced it by a packed copy."""
        self._parameters.pop(name, None)
        self._buffers.pop(name, None)

    @property
    def gemm(self):
        """workers/cpu_ops when every linear layer runs on gemm.c, else None."""
        return self.ops.gemm if isinstance(self.ops, GemmOps) else None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None,
                lora=None) -> torch.Tensor:
        """Hidden states after the last layer, of every token or of `out_rows` (indices) only.
        Every token's K/V reaches the cache either way.

        `out_rows`, where the strategy's rows are independent (gemm.c): after the last
        layer's attention (which every token's K/V and query still go through), only those
        rows go on through its o projection and MLP, 84% of a layer's weights: a 1,024-token
        prefill step that samples 4 rows skips a thirtieth of its GEMMs, and the kept rows
        are bit-identical. Elsewhere every row runs and the result is indexed.

        `lora`: the step's workers.lora.batch.LoRABatch when some rows use an adapter; its
        deltas are added after the qkv, o, gate/up and down projections (lora/layer.py)."""
        t = input_ids.shape[0]
        ops = self.small_ops if t <= self.int4_max_tokens and lora is None else self.ops
        if out_rows is not None and not ops.rows_independent:
            return self.forward(input_ids, positions, kv_caches, meta, lora=lora)[out_rows]
        cfg = self.config
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_size, scale, attn = cfg.q_size + cfg.kv_size, self.scale, self.backend.forward
        rope = ops.rope(positions, self.rope, t)
        if meta.positions is None:  # for a backend that applies RoPE itself
            meta.positions = positions
        x = F.embedding(input_ids, self.embed)
        layers = self.layers
        last = len(layers) - 1
        h = ops.norm(x, layers[0].input_norm)
        for i, (lw, cache) in enumerate(zip(layers, kv_caches)):
            if lora is not None and not isinstance(h, torch.Tensor):
                h = h.materialize()   # a strategy's pending norm (cuda_ops.PendingNorm): LoRA reads h
            qkv = ops.qkv(h, lw)
            if lora is not None:
                lora.apply(i, "qkv", h, qkv)
            qk = rope(qkv)
            o = attn(qk[:, :nh], qk[:, nh:], qkv[:, qk_size:].view(t, nkv, hd), cache, meta, scale)
            if i == last and out_rows is not None:
                if not out_rows.numel():  # a step that samples nothing (a prompt's middle chunk)
                    return x[:0]
                o, x = o[out_rows], x[out_rows]
                lora = lora.select(out_rows) if lora is not None else None
            if lora is not None:
                x, h = lora_layer.o_add_norm(ops, lora, i, o.reshape(o.shape[0], -1), lw, x)
                x, h = lora_layer.mlp_add_norm(ops, lora, i, h, lw, x,
                                               layers[i + 1].input_norm if i < last else None)
                continue
            x, h = ops.o_add_norm(o.reshape(o.shape[0], -1), lw, x)
            x, h = ops.mlp_add_norm(h, lw, x, layers[i + 1].input_norm if i < last else None)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the sampled rows only; float32 for the sampler."""
        return self._head(self._normed(hidden))

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden, (self.config.hidden_size,), self.final_norm, self.config.rms_norm_eps)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.head(h, self.lm_head).float()

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
