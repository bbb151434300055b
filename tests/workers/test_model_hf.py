"""The Hugging Face directory loader on tiny random checkpoints, against transformers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from kvyard.common.models import resolve_model
from kvyard.workers.attention.reference import SeqStep, build_metadata
from kvyard.workers.model import kv_cache_shape, load_model

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}

CASES = {
    "llama3-rope-gqa-untied": lambda: LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                                                  rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False),
    "llama-mha-tied": lambda: LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=4,
                                          tie_word_embeddings=True),
    "qwen2-bias-gqa-tied": lambda: Qwen2Config(**SMALL, num_attention_heads=8, num_key_value_heads=2,
                                               tie_word_embeddings=True),
    "qwen2-bias-mqa-untied": lambda: Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=1,
                                                 tie_word_embeddings=False, rope_theta=1e6),
}


def _save(cfg, path: Path, shard: str | None = None):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # defaults (unit norms, zero biases) would hide mix-ups
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(path, **kwargs)
    return hf


def _ours(model, cfg, ids: list[int]) -> torch.Tensor:
    n, bs = len(ids), 8
    blocks = list(range(-(-n // bs)))[::-1]  # reversed: block order must not matter
    caches = [torch.zeros(kv_cache_shape(cfg, len(blocks), bs), dtype=model.dtype) for _ in range(cfg.num_layers)]
    meta = build_metadata([SeqStep(blocks, 0, n)], bs, 0)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    hf = _save(CASES[case](), tmp_path)
    model, cfg = load_model(resolve_model(str(tmp_path)), torch.float32)
    assert cfg.attention_bias == case.startswith("qwen2")
    assert cfg.tie_word_embeddings == ("-tied" in case)
    ids = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    got = _ours(model, cfg, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_and_bfloat16(tmp_path: Path) -> None:
    hf = _save(CASES["llama3-rope-gqa-untied"](), tmp_path, shard="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, cfg = load_model(resolve_model(str(tmp_path)), torch.bfloat16)
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert model.dtype == torch.bfloat16
    ids = list(range(3, 60))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    got = _ours(model, cfg, ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1
