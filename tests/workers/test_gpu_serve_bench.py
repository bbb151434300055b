"""`kvyard bench gpu --parts serve`'s machinery on the CPU: a real `kvyard worker` on a tiny
random HF directory (with the bench's word-level tokenizer), the streaming aiohttp client,
per-level TTFT/TPOT/tok/s and the in-process baseline (on the H200 it runs the 8B shape)."""
from __future__ import annotations

import argparse

import pytest
import torch

from kvyard.bench.gpu_serve import serve
from kvyard.bench.report import percentile


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-serve")
    LlamaForCausalLM(cfg).float().save_pretrained(d, safe_serialization=True)
    return str(d)


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(range(101)), 99) == 99
    assert percentile([5.0], 99) == 5.0


def test_serve_levels_against_a_real_worker(tiny_dir) -> None:
    args = argparse.Namespace(serve_concurrency="1,3", serve_prompt=8, serve_new=5,
                              serve_requests_per_stream=2,
                              serve_worker_args=["--num-threads", "1"])
    out = serve(torch, args, tiny_dir, device="cpu")
    assert out["worker_exit"] == 0, out["worker_log_tail"]
    assert set(out["levels"]) == {"1", "3"}
    for c, r in out["levels"].items():
        assert r["requests"] == 2 * int(c)
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] < 60
        assert 0 <= r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        assert r["tok_s"] > 0 and r["offline_tok_s"] > 0
        assert r["vs_offline"] == pytest.approx(r["tok_s"] / r["offline_tok_s"])
