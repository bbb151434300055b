"""The Llama-3-8B-shape decode step behind `kvyard bench gpu`'s `decode` rows.

Random bf16 weights of the real shapes; every sequence at the same context.
Each variant is one whole step (embedding to logits, all layers) captured in
one CUDA graph, so launch overhead is what a graph replay costs and the
variants differ only where named:
  ref        plain torch: cuBLAS GEMMs, RoPE in torch, KV written by
             index_put into contiguous [B, kv_heads, ctx, head_dim] caches,
             torch SDPA over them (the dispatcher's choice);
  kvyard     the same GEMMs, norms and RoPE; KV written by slot mapping into
             the paged cache (`write_kv`) and `paged_decode` over it;
  fused      kvyard with RoPE done inside the KV write (`rope_write_kv`);
  norm       fused plus the engine's CUDA ops (workers/model/cuda_ops.py):
             residual add + RMSNorm in one pass, SiLU(gate) * up in one pass;
  engine     the engine's own model (LlamaForCausalLM on CudaOps + the Triton
             backend, loaded through `build` from random weights of this shape):
             what `kvyard worker --device cuda` replays per decode step;
  gemms      only the step's GEMMs (the cuBLAS floor: what no attention or
             elementwise work can beat without other GEMMs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvyard.workers.attention import AttentionMetadata
from kvyard.workers.attention.triton_backend import TRITON_PLAN_KEY, DevicePlan
from kvyard.workers.attention.triton_decode import DecodeConfig, DecodeWorkspace, paged_decode
from kvyard.workers.attention.triton_kv_write import rope_write_kv, write_kv
from kvyard.workers.model.config import ModelConfig
from kvyard.workers.model.cuda_ops import add_rms_norm as _add_rms_norm, silu_mul
from kvyard.workers.model.rope import apply_rope

DEV, DTYPE = "cuda", torch.bfloat16
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 32, 8, 128, 14336, 128256
BLOCK = 16
EPS = 1e-5


def add_rms_norm(x: Any, res: Any, w: Any) -> Any:
    return _add_rms_norm(x, res, w, EPS)


@dataclass(slots=True)
class Weights:
    embed: Any
    head: Any
    norm: Any
    layers: list[dict[str, Any]]
    cos: Any      # [max_pos, head_dim / 2]
    sin: Any
    table: Any    # rope.py's layout [max_pos, 2, 2, head_dim / 2]

    def bytes_per_step(self, batch: int) -> int:
        """Bytes a step must read: every layer weight, the final norm and head, the batch's embedding rows."""
        per_layer = sum(t.numel() * t.element_size() for w in self.layers for t in w.values())
        return per_layer + self.head.numel() * 2 + self.norm.numel() * 2 + batch * HIDDEN * 2


def make_weights(layers: int, max_pos: int) -> Weights:
    def w(*shape: int) -> Any:
        return torch.randn(*shape, dtype=DTYPE, device=DEV) * shape[-1] ** -0.5

    ones = lambda: torch.ones(HIDDEN, dtype=DTYPE, device=DEV)  # noqa: E731
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    lw = [dict(n1=ones(), qkv=w(qkv, HIDDEN), o=w(HIDDEN, HIDDEN), n2=ones(), gu=w(2 * INTER, HIDDEN),
               down=w(HIDDEN, INTER)) for _ in range(layers)]
    inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=DEV).float() / HEAD_DIM)
    ang = torch.outer(torch.arange(max_pos, device=DEV).float(), inv)
    cos, sin = ang.cos(), ang.sin()
    table = torch.stack((torch.stack((cos, cos), 1), torch.stack((-sin, sin), 1)), 1).to(DTYPE)
    return Weights(w(VOCAB, HIDDEN), w(VOCAB, HIDDEN), ones(), lw, table[:, 0, 0], table[:, 1, 1], table)


@dataclass(slots=True)
class Batch:
    """One decode step's inputs and both cache layouts holding the same K/V values."""

    ids: Any
    pos: Any            # [B] int64, the new token's position (context - 1)
    slots: Any          # [B] int64
    tables: Any         # [B, ctx / BLOCK] int32, or wider, zero-padded (make_batch's max_len)
    lens: Any           # [B] int32
    paged: list[Any]    # per layer [2, blocks, BLOCK, KV_HEADS, HEAD_DIM]
    dense: list[Any]    # per layer (k, v), each [B, KV_HEADS, ctx, HEAD_DIM]

    def kv_bytes(self) -> int:
        """K and V rows of every context token, each row as the paged cache stores it (bf16, or a
        quantized format's codes and scale)."""
        B, ctx = self.tables.shape[0], int(self.lens[0])
        row = self.paged[0].shape[-1] * self.paged[0].element_size()
        return len(self.paged) * 2 * B * ctx * KV_HEADS * row


def make_batch(batch: int, ctx: int, layers: int, dense: bool = True, max_len: int | None = None) -> Batch:
    """max_len: block tables as wide as max_len's blocks, zero-padded past the context, as the
    engine's CUDA-graph buffers are (max_model_len wide): paged_decode's default splits follow the
    tables' width, so a bench of the engine's step gets the engine's splits."""
    nb = ctx // BLOCK
    perm = torch.randperm(batch * nb, device=DEV)  # blocks scattered, as a running server's are
    tables = perm.view(batch, nb).to(torch.int32)
    tok = torch.arange(ctx, device=DEV)
    all_slots = (tables[:, tok // BLOCK].long() * BLOCK + tok % BLOCK).reshape(-1)
    paged, dcache = [], []
    for _ in range(layers):
        kv = torch.randn(2, batch, KV_HEADS, ctx, HEAD_DIM, dtype=DTYPE, device=DEV)
        p = torch.empty(2, batch * nb, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        p.view(2, -1, KV_HEADS, HEAD_DIM)[:, all_slots] = kv.permute(0, 1, 3, 2, 4).reshape(2, -1, KV_HEADS, HEAD_DIM)
        paged.append(p)
        if dense:
            dcache.append((kv[0], kv[1]))
        del kv
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=DEV)
    slots = tables[:, -1].long() * BLOCK + (ctx - 1) % BLOCK
    if max_len is not None and max_len // BLOCK > nb:
        tables = torch.nn.functional.pad(tables, (0, max_len // BLOCK - nb))
    return Batch(ids=torch.randint(0, VOCAB, (batch,), device=DEV), pos=pos, slots=slots, tables=tables,
                 lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEV), paged=paged, dense=dcache)


def step_fn(variant: str, w: Weights, b: Batch, decode_cfg: DecodeConfig) -> Callable[[], Any]:
    """The step as a closure over persistent tensors (capturable)."""
    B = b.ids.shape[0]
    scale = HEAD_DIM ** -0.5
    ws = None
    if decode_cfg.num_splits > 1:
        ws = DecodeWorkspace.allocate(B, HEADS, HEAD_DIM, decode_cfg.num_splits, DEV)
    attn_out = torch.empty(B, HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    act = torch.randn(B, INTER, dtype=DTYPE, device=DEV)  # gemms: contiguous stand-in inputs
    bidx = torch.arange(B, device=DEV)

    def attention(li: int, qkv: Any) -> Any:
        qkv = qkv.view(B, HEADS + 2 * KV_HEADS, HEAD_DIM)
        if variant in ("fused", "norm"):
            q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
            rope_write_kv(q, k, v, b.paged[li], b.slots, b.pos, w.cos, w.sin)
        else:
            qk = apply_rope(qkv[:, :HEADS + KV_HEADS], w.table[b.pos][:, None])
            q, k, v = qk[:, :HEADS], qk[:, HEADS:], qkv[:, HEADS + KV_HEADS:]
        if variant == "ref":
            kc, vc = b.dense[li]
            kc[bidx, :, b.pos] = k
            vc[bidx, :, b.pos] = v
            o = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, scale=scale, enable_gqa=True)
            return o.reshape(B, HIDDEN)
        if variant == "kvyard":
            write_kv(k, v, b.paged[li], b.slots)
        paged_decode(q, b.paged[li], b.tables, b.lens, scale, out=attn_out, config=decode_cfg, workspace=ws)
        return attn_out.view(B, HIDDEN)

    def step_norm() -> Any:
        h = w.embed[b.ids]
        x = F.rms_norm(h, (HIDDEN,), w.layers[0]["n1"], EPS)
        for li, lw in enumerate(w.layers):
            x = add_rms_norm(F.linear(attention(li, F.linear(x, lw["qkv"])), lw["o"]), h, lw["n2"])
            d = F.linear(silu_mul(F.linear(x, lw["gu"])), lw["down"])
            nxt = w.layers[li + 1]["n1"] if li + 1 < len(w.layers) else w.norm
            x = add_rms_norm(d, h, nxt)
        return F.linear(x, w.head)

    def step() -> Any:
        h = w.embed[b.ids]
        for li, lw in enumerate(w.layers):
            if variant == "gemms":
                F.linear(h, lw["qkv"])
                F.linear(F.linear(attn_out.view(B, HIDDEN), lw["o"]), lw["gu"])
                h = F.linear(act, lw["down"])
                continue
            x = F.rms_norm(h, (HIDDEN,), lw["n1"], EPS)
            h = h + F.linear(attention(li, F.linear(x, lw["qkv"])), lw["o"])
            x = F.rms_norm(h, (HIDDEN,), lw["n2"], EPS)
            g, u = F.linear(x, lw["gu"]).chunk(2, -1)
            h = h + F.linear(F.silu(g) * u, lw["down"])
        return F.linear(F.rms_norm(h, (HIDDEN,), w.norm, EPS), w.head)

    return step_norm if variant == "norm" else step


def capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Warm up on a side stream (Triton compiles, cuBLAS picks), then capture one replayable graph."""
    from kvyard.workers.engine.cuda_runner import capture_graph

    return capture_graph(fn)


def config_8b(max_pos: int = 8192) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                       num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       rms_norm_eps=EPS, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=max_pos,
                       tie_word_embeddings=False, attention_bias=False)


class RandomSource:
    """A WeightSource of random bf16 tensors made on the GPU (no checkpoint: speed only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
        self.shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
                       "model.norm.weight": (h,)}
        per = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
               "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
               "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
               "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        for layer in range(cfg.num_layers):
            self.shapes.update({f"model.layers.{layer}.{k}": v for k, v in per.items()})

    def has(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> Any:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=DTYPE, device=DEV)
        return torch.randn(shape, dtype=DTYPE, device=DEV) * shape[-1] ** -0.5

    def get_int4(self, name: str) -> None:
        return None

    def get_quant(self, name: str) -> None:
        return None


def engine_model(layers: int, max_pos: int) -> Any:
    from dataclasses import replace

    from kvyard.workers.model.loader import build

    cfg = replace(config_8b(max_pos), num_layers=layers)
    return build(cfg, RandomSource(cfg), DTYPE, max_pos, device=DEV)


def engine_step_fn(model: Any, b: Batch) -> Callable[[], Any]:
    """The engine's decode step over the batch's paged caches, metadata as persistent device tensors."""
    B = b.ids.shape[0]
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    meta = AttentionMetadata(slot_mapping=b.slots, query_start_loc=list(range(B + 1)), seq_lens=[1] * B,
                             block_tables=b.tables, num_decodes=B)
    meta.scratch[TRITON_PLAN_KEY] = DevicePlan(b.slots, b.tables, b.lens, qsl, 0, b.pos)

    def step() -> Any:
        return model.compute_logits(model(b.ids, b.pos, b.paged, meta))

    step.meta = meta  # type: ignore[attr-defined]  # what the captured graph reads lives with the closure
    return step


def kernel_profile(fn: Callable[[], Any], steps: int = 3, top: int = 25) -> dict[str, Any]:
    """GPU time per kernel name over `steps` eager calls of fn (what a graph replays; launch gaps
    are not counted). No graph can be captured in a process after this has run."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            rows.append({"kernel": e.key[:90], "ms_per_step": round(us / steps / 1e3, 4),
                         "calls_per_step": e.count // steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return {"total_ms": round(sum(r["ms_per_step"] for r in rows), 3), "kernels": rows[:top]}
