"""`load_model`: checkpoint (GGUF file or HF directory) -> ready-to-run model.

Both formats are first exposed as a `WeightSource` that yields tensors under
Hugging Face names, loaded one at a time; `build` then fuses and casts layer
by layer, so peak memory stays near the final model's size.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Protocol

import torch
from tqdm import tqdm

from kvyard.common.models import ModelSource

from ..attention.torch_cpu import TorchCPUBackend
from .config import ModelConfig, config_from_gguf, config_from_hf
from .. import cpu_ops
from .gguf_file import GGUFFile, int4_parts, quant_parts
from .linear_ops import GemmOps
from .ops import select_ops
from .llama import Int4Weight, LayerWeights, LlamaForCausalLM
from .quant import validate_method
from .quant.apply import quantized_matrix, target_for
from .rope import rope_table
from . import weight_cache

_PROGRESS_MIN_BYTES = 1 << 30  # smaller checkpoints load in seconds; no bar


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...
    def get(self, name: str) -> torch.Tensor: ...
    def get_int4(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...
    def get_quant(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float] | None: ...


class SafetensorsSource:
    """An HF directory's *.safetensors shards, memory-mapped; tensors read on demand."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.exists():  # only the shards it names (some repos also ship consolidated copies)
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [directory / n for n in names]
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory}: no *.safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}
        self.nbytes = sum(f.stat().st_size for f in files)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def get_int4(self, name: str) -> None:
        return None  # float checkpoints: re-quantising would change the model

    def get_quant(self, name: str) -> None:
        return None


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


class GGUFSource:
    """A GGUF file seen through HF names, dequantised on demand.

    llama.cpp's converter interleaves the two RoPE halves of every Q/K head
    for `llama`-arch files (it rotates adjacent pairs); we undo that here so
    one rotate-half RoPE serves every checkpoint format.
    """

    def __init__(self, f: GGUFFile, cfg: ModelConfig) -> None:
        self.f, self.cfg = f, cfg
        self.unpermute = f.meta["general.architecture"] != "qwen2"
        self.nbytes = f.path.stat().st_size

    def _name(self, hf: str) -> str:
        if hf in _GGUF_TOP:
            return _GGUF_TOP[hf]
        _, _, idx, rest = hf.split(".", 3)  # model.layers.{i}.{rest}
        return f"blk.{idx}.{_GGUF_LAYER[rest]}"

    def has(self, name: str) -> bool:
        return self._name(name) in self.f.tensors

    def _unpermute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.unpermute and (".q_proj." in name or ".k_proj." in name):
            heads = self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
            rows = t.shape[0]
            t = t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
        return t

    def get(self, name: str) -> torch.Tensor:
        return self._unpermute(name, self.f.load(self._name(name)))

    def get_int4(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        t = self.f.tensors[self._name(name)]
        parts = int4_parts(self.f.raw(t.name), t.qtype, t.shape)
        return None if parts is None else tuple(self._unpermute(name, p) for p in parts)  # type: ignore[return-value]

    def get_quant(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float] | None:
        t = self.f.tensors[self._name(name)]
        parts = quant_parts(self.f.raw(t.name), t.qtype, t.shape)
        if parts is None:
            return None
        codes, d, m, bits, off = parts
        return self._unpermute(name, codes), self._unpermute(name, d), self._unpermute(name, m), bits, off


def _quant(src: WeightSource, names: list[str], dtype: torch.dtype) -> cpu_ops.GemmWeight | None:
    """Row-fused GEMM tiles of `names` straight from the file's 32-blocks (no dense copy),
    or None unless every part is Q4_0/Q4_1/Q8_0 of one kind (see gemm_quant.h)."""
    parts = [src.get_quant(n) for n in names]
    if any(p is None for p in parts) or len({(p[3], p[4]) for p in parts}) != 1:  # type: ignore[index]
        return None
    codes, d, m = (torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[index]
    return cpu_ops.GemmWeight.pack_quant(codes, d, m, parts[0][3], parts[0][4], dtype)  # type: ignore[index]


def _int4(src: WeightSource, names: list[str], dtype: torch.dtype) -> Int4Weight | None:
    """Row-fused int4 weight of `names`, or None unless every part is stored as 4-bit."""
    parts = [src.get_int4(n) for n in names]
    if any(p is None for p in parts):
        return None
    codes, scale, zero = (torch.cat([p[i] for p in parts], 0) for i in range(3))  # type: ignore[index]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    return Int4Weight(packed, torch.stack((scale.t(), zero.t()), -1).to(dtype).contiguous())


def build(cfg: ModelConfig, src: WeightSource, dtype: torch.dtype, max_len: int | None = None,
          freq_factors: torch.Tensor | None = None, progress: bool = False,
          int4_max_tokens: int = 8, cpu_kernels: bool = True,
          device: torch.device | str = "cpu", ops=None, backend=None,
          quantization: str | None = None) -> LlamaForCausalLM:
    """The model on `device` with the linear-ops strategy `select_ops` picks there and the
    attention backend for the device (`ops`, `backend`: others, for tests). `quantization`:
    int8 | fp8 | int4 quantize the layers' matrices here (quant/apply.py; the head and the
    embedding stay as loaded), gguf keeps a GGUF's Q4/Q8 blocks as stored in bf16 too."""
    validate_method(quantization)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    def w(name: str) -> torch.Tensor:
        return src.get(name).to(device=device, dtype=dtype)

    def cat(*names: str) -> torch.Tensor:
        """Fuse along rows, casting while copying into one buffer (one pass per part)."""
        parts = [src.get(n) for n in names]
        out = torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=dtype, device=device)
        row = 0
        for p in parts:
            out[row:row + p.shape[0]].copy_(p)
            row += p.shape[0]
        return out

    ops = ops or select_ops(cfg, dtype, device, cpu_kernels)
    tiled = isinstance(ops, GemmOps)
    if tiled or device.type != "cpu":
        int4_max_tokens = 0  # gemm.c serves every step size, faster than torch's int4 kernel here
    # float32 reads GGUF blocks in place (5-9 bits a weight, expanded exactly: measured 1.1-1.9x
    # faster at 1 row, even at 32); bf16 keeps dense tiles, faster there than expanding blocks
    quant_tiles = tiled and (dtype == torch.float32 or quantization == "gguf")
    requant = quantization not in (None, "gguf")
    target = target_for(ops)

    def mat(*names: str) -> torch.Tensor | cpu_ops.GemmWeight:
        """Rows of `names` fused: quantized GEMM tiles when the file allows, else dense."""
        if requant:  # from the checkpoint's float values (a GGUF's dequantized ones)
            return quantized_matrix([src.get(n) for n in names], quantization, dtype, device, target)
        q = _quant(src, list(names), dtype) if quant_tiles else None
        if q is not None:
            return q
        return cat(*names) if len(names) > 1 else w(names[0]).contiguous()

    layers = []
    for i in tqdm(range(cfg.num_layers), desc="loading layers", unit="layer", disable=not progress):
        p = f"model.layers.{i}."
        qkv_b = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        int4 = None
        if int4_max_tokens > 0 and dtype == torch.bfloat16 and quantization is None:  # torch's fp32 int4 kernel is slow (CPU only)
            ws = [_int4(src, [p + f"self_attn.{x}_proj.weight" for x in "qkv"], dtype),
                  _int4(src, [p + "self_attn.o_proj.weight"], dtype),
                  _int4(src, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], dtype),
                  _int4(src, [p + "mlp.down_proj.weight"], dtype)]
            int4 = tuple(ws) if all(w is not None for w in ws) else None
        g_name, u_name = p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"
        gate, up = (mat(g_name), mat(u_name)) if tiled else (None, None)
        split = isinstance(gate, cpu_ops.GemmWeight) and isinstance(up, cpu_ops.GemmWeight)
        layers.append(LayerWeights(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=mat(*(p + f"self_attn.{x}_proj.weight" for x in "qkv")),  # type: ignore[arg-type]
            qkv_bias=cat(*qkv_b) if src.has(qkv_b[0]) else None,
            o=mat(p + "self_attn.o_proj.weight"),  # type: ignore[arg-type]
            o_bias=w(p + "self_attn.o_proj.bias") if src.has(p + "self_attn.o_proj.bias") else None,
            post_norm=w(p + "post_attention_layernorm.weight"),
            gate_up=None if split else mat(g_name, u_name) if requant else cat(g_name, u_name),
            down=mat(p + "mlp.down_proj.weight"),  # type: ignore[arg-type]
            int4=int4,  # type: ignore[arg-type]
            gate=gate if split else None,  # type: ignore[arg-type]
            up=up if split else None,  # type: ignore[arg-type]
        ))
    embed = w("model.embed_tokens.weight").contiguous()
    tied = cfg.tie_word_embeddings or not src.has("lm_head.weight")
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    lm_head = (_quant(src, [head_name], dtype) if quant_tiles else None) or (embed if tied else w(head_name).contiguous())
    rope = rope_table(cfg, max_len or cfg.max_position_embeddings, dtype, freq_factors).to(device)
    if backend is None and (device.type == "cuda" or hasattr(ops, "rope_in_attention")):  # CudaOps
        from ..attention.triton_backend import TritonBackend

        # CudaOps leaves RoPE to the KV write: cos and +sin halves of the table
        backend = TritonBackend((rope[:, 0, 0], rope[:, 1, 1]) if getattr(ops, "rope_in_attention", False) else None)
    backend = backend or TorchCPUBackend()
    model = LlamaForCausalLM(cfg, embed, layers, w("model.norm.weight"), lm_head, rope, backend,
                             int4_max_tokens, tied=tied, ops=ops)
    model.eval().requires_grad_(False)
    return model


def load_model(src: ModelSource, dtype: torch.dtype, max_len: int | None = None,
               on_progress: Callable[[str], None] | None = None,
               int4_max_tokens: int = 8, cpu_kernels: bool = True,
               device: torch.device | str = "cpu",
               quantization: str | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load `src` (from `kvyard.common.models.resolve_model`) in `dtype` (float32 or bfloat16).

    `max_len` bounds the RoPE table (defaults to the model's max positions).
    `int4_max_tokens`: for 4-bit GGUF layers, steps of at most this many tokens
    run on the packed int4 weights (exact for Q4_0/Q4_1, ~4x fewer bytes read);
    bfloat16 only (torch's float32 int4 kernel is slower than dense float32);
    0 keeps every step on the dense weights. Where workers/cpu_ops/gemm.c runs
    (AVX-512; AVX512-BF16 for bf16) it serves every step and int4 is not built.
    `cpu_kernels=False` keeps the model on torch's ops (tests compare the two).
    `device`: where weights live and the step runs ('cuda': cuBLAS + Triton, cuda_ops.py).
    `quantization` (vLLM's `--quantization`): None keeps the checkpoint's precision (a GGUF's
    Q4/Q8 blocks read in place in float32); int8 | fp8 | int4 quantize the linear layers at
    load, gguf reads the GGUF's blocks in place in bf16 too (see docs/quantization.md).
    """
    validate_method(quantization)
    t0 = time.perf_counter()
    if src.kind == "gguf":
        f = GGUFFile(src.path)
        cfg = config_from_gguf(f.meta, {n: t.shape for n, t in f.tensors.items()})
        factors = f.load("rope_freqs.weight") if "rope_freqs.weight" in f.tensors else None
        weights: GGUFSource | SafetensorsSource = GGUFSource(f, cfg)
    elif src.kind == "hf":
        cfg = config_from_hf(json.loads((Path(src.path) / "config.json").read_text()))
        factors = None
        weights = SafetensorsSource(Path(src.path))
    else:
        raise ValueError(f"unknown model source kind {src.kind!r}")
    with torch.inference_mode():
        # A CPU model's built weights come back memory-mapped from weight_cache when this
        # file, dtype and kernel build were built before (a cold start skips the packing).
        ops = select_ops(cfg, dtype, torch.device(device), cpu_kernels) \
            if torch.device(device).type == "cpu" else None
        # quantized models are not cached: the cache's key does not name a format
        cache = weight_cache.path_for(src, dtype, ops) if ops is not None and quantization is None else None
        got = weight_cache.load(cache) if cache is not None else None
        if got is not None:
            rope = rope_table(cfg, max_len or cfg.max_position_embeddings, dtype, factors)
            model = LlamaForCausalLM(cfg, got["embed"], got["layers"], got["final_norm"],
                                     got["lm_head"], rope, TorchCPUBackend(),
                                     got["int4_max_tokens"], tied=got["tied"], ops=ops)
            model.eval().requires_grad_(False)
        else:
            model = build(cfg, weights, dtype, max_len, factors,
                          progress=weights.nbytes >= _PROGRESS_MIN_BYTES,
                          int4_max_tokens=int4_max_tokens, cpu_kernels=cpu_kernels,
                          device=device, ops=ops, quantization=quantization)
            if cache is not None:
                weight_cache.save(cache, model)
    if on_progress:
        on_progress(f"loaded {src.served_name} in {time.perf_counter() - t0:.1f}s")
    return model, cfg


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
    """One layer's cache: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
    return (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
