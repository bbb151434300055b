"""GGUF files we write ourselves (PyPI gguf's writer, llama.cpp's tensor conventions)
from tiny random HF models: the GGUF loader must reproduce transformers' logits.

Covers what the demo file does not: the qwen2 architecture (biases, no Q/K
permutation), an untied output head, and the Q4_0 / Q8_0 / F16 decoders.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from kvyard.common.models import resolve_model
from kvyard.workers.attention.reference import SeqStep, build_metadata
from kvyard.workers.model import kv_cache_shape, load_model

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave each head's two rotary halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(hf, arch: str, path: Path, qtype: Q) -> dict[str, torch.Tensor]:
    """Write `hf` as GGUF; 2-D layer weights in `qtype`. Returns HF-named weights as
    the file holds them (after quantisation), to load back into the reference."""
    c = hf.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    held: dict[str, torch.Tensor] = {}
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = p.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{NAMES[mod]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        stored = a
        if arch == "llama" and (".q_proj.w" in name or ".k_proj.w" in name):
            heads = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
            stored = _llama_cpp_permute(a, heads)
        if a.ndim == 2 and name.startswith("model.layers."):
            data = quantize(stored, qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
            a = dequantize(quantize(a, qtype), qtype)  # same values, unpermuted order
        elif a.ndim == 2:
            w.add_tensor(gname, stored.astype(np.float16), raw_dtype=Q.F16)
            a = stored.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(gname, stored)
        held[name] = torch.from_numpy(np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


CASES = {
    "llama-q4_0-untied": (lambda: LlamaConfig(**SMALL, tie_word_embeddings=False), "llama", Q.Q4_0),
    "llama-q8_0-tied": (lambda: LlamaConfig(**SMALL, tie_word_embeddings=True), "llama", Q.Q8_0),
    "qwen2-q4_1-tied": (lambda: Qwen2Config(**SMALL, tie_word_embeddings=True), "qwen2", Q.Q4_1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_written_gguf_matches_transformers(case: str, tmp_path: Path) -> None:
    make, arch, qtype = CASES[case]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
    held = _write(hf, arch, tmp_path / "m.gguf", qtype)
    hf.load_state_dict(held, strict=False)  # the reference computes with the file's values

    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 0.15)):
        model, cfg = load_model(resolve_model(str(tmp_path / "m.gguf")), dtype)
        assert cfg.architecture == arch and cfg.attention_bias == (arch == "qwen2")
        assert cfg.tie_word_embeddings == ("-tied" in case)
        caches = [torch.zeros(kv_cache_shape(cfg, 5, 8), dtype=dtype) for _ in range(cfg.num_layers)]
        with torch.inference_mode():
            # 8 tokens: at or below int4_max_tokens, so bf16 Q4 files take the int4 path
            meta = build_metadata([SeqStep([4, 0, 3, 1, 2], 0, 8)], 8, 0)
            got = model.compute_logits(model(torch.tensor(ids[:8]), torch.arange(8), caches, meta))
            meta = build_metadata([SeqStep([4, 0, 3, 1, 2], 8, 32)], 8, 0)
            got = torch.cat((got, model.compute_logits(
                model(torch.tensor(ids[8:]), torch.arange(8, 40), caches, meta))))
        assert (got - ref).abs().max().item() < tol, (dtype, (got - ref).abs().max().item())
        uses_int4 = dtype == torch.bfloat16 and qtype in (Q.Q4_0, Q.Q4_1) and model.gemm is None
        assert (model.int4_max_tokens > 0) == uses_int4
