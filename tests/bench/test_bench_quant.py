"""`kvyard bench quant`'s pieces: the shipped data, the divergence and multiple-choice
arithmetic, gpu_quant's roofline and FLOP counts, and the API path end to end: a real
`kvyard worker --quantization int8` whose echoed prompt logprobs are the in-process
quantized model's (so the bench's perplexity and MC scores measure that model).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from kvyard.bench import gpu_quant
from kvyard.bench.quant import kv_dtypes_available, model_bytes
from kvyard.bench.quant_accuracy import (api_multiple_choice, api_perplexity, divergence, mc_items,
                                         mc_requests, text_windows, window_logprobs)
from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers.server.testing import start_worker


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


def test_shipped_data(tok) -> None:
    wins = text_windows(tok, 256, None)
    assert len(wins) >= 15 and all(len(w) == 256 for w in wins)  # a few thousand tokens
    items = mc_items()
    assert len(items) == 48 and all(len(i["choices"]) == 4 for i in items)
    assert sorted({i["answer"] for i in items}) == [0, 1, 2, 3]


def test_mc_split_is_the_context_boundary(tok) -> None:
    items = mc_items()[:2]
    prompts, conts = mc_requests(tok, items)
    assert len(prompts) == 8
    for p, n, c in zip(prompts, conts, [c for it in items for c in it["choices"]]):
        assert 0 < n < len(p) and tok.decode(p[-n:]).strip() == c


def test_divergence() -> None:
    a = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]), -1)
    assert divergence([a], [a]).agreement == 1.0 and divergence([a], [a]).kl == 0.0
    b = torch.log_softmax(torch.tensor([[0.0, 2.0, -1.0], [0.0, 1.0, 0.0]]), -1)
    d = divergence([a], [b])
    assert d.agreement == 0.5 and d.kl > 0


def test_gpu_quant_arithmetic() -> None:
    assert gpu_quant.roofline_frac(2_000, 1.0, 4_000.0) == 0.5
    assert math.isnan(gpu_quant.roofline_frac(1, 0.0, 1.0))
    from kvyard.bench.gpu_step import config_8b

    cfg = config_8b()
    params = gpu_quant.layer_params(cfg)
    assert 7.0e9 < params < 7.6e9  # Llama-3-8B less its embedding
    assert gpu_quant.prefill_flops(cfg, 10, params) > 2 * params * 10


def test_engine_step_batch_has_the_engines_table_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_quant's batches carry block tables as wide as the model's max length, zero-padded, as
    the engine's graph buffers do (paged_decode's default splits follow that width); the new
    token's slot, the lengths and the KV bytes stay the context's."""
    from kvyard.bench import gpu_step as gs
    from kvyard.workers.attention.triton_decode import decode_config

    monkeypatch.setattr(gs, "DEV", "cpu")
    narrow = gs.make_batch(2, 64, 1, dense=False)
    torch.manual_seed(0)
    wide = gs.make_batch(2, 64, 1, dense=False, max_len=64 + 2048)
    torch.manual_seed(0)
    again = gs.make_batch(2, 64, 1, dense=False)
    assert narrow.tables.shape == (2, 4) and wide.tables.shape == (2, (64 + 2048) // gs.BLOCK)
    assert torch.equal(wide.tables[:, :4], again.tables) and not wide.tables[:, 4:].any()
    assert torch.equal(wide.slots, again.slots) and torch.equal(wide.lens, again.lens)
    assert wide.kv_bytes() == again.kv_bytes()
    # at batch 1 the engine's width splits a 1,024-token context finer than the context's own
    ctx_splits = decode_config(1, gs.KV_HEADS, 1024, 132).num_splits
    assert decode_config(1, gs.KV_HEADS, 1024 + 2048, 132).num_splits > ctx_splits


@pytest.mark.parametrize("kv,row", [("fp8_e4m3", 128), ("fp8", 132), ("int8", 132)])
def test_gpu_quant_restores_the_batch_in_each_kv_format(monkeypatch: pytest.MonkeyPatch, kv: str,
                                                        row: int) -> None:
    """Each weight mode also decodes over quantized KV: the batch's caches re-stored in the format
    (the same K/V to the format's precision), the roofline's KV bytes those rows as stored."""
    from kvyard.bench import gpu_step as gs
    from kvyard.workers.attention import kv_quant

    monkeypatch.setattr(gs, "DEV", "cpu")
    b = gs.make_batch(2, 32, 2, dense=False)
    bf16_bytes, before = b.kv_bytes(), b.paged[1].clone()
    gpu_quant.in_kv_format(torch, b, kv)
    assert kv_quant.format_of(b.paged[1]).name == kv
    assert b.kv_bytes() * 256 == bf16_bytes * row
    back = kv_quant.dequantize(b.paged[1]).float()
    assert torch.allclose(back, before.float(), rtol=0.07, atol=0.02)
    gpu_quant.in_kv_format(torch, b, "bf16")   # bf16: left as it is
    assert kv_quant.format_of(b.paged[1]).name == kv


def test_gpu_quant_refuses_unknown_kv_dtypes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu_quant.main(["--out", os.devnull, "--kv-dtypes", "bf16,fp4"])
    assert "--kv-dtypes" in capsys.readouterr().err


def test_gpu_gemv_products_are_an_8b_layers_weights() -> None:
    """gpu_gemv times the four GEMVs of a decode layer: together they are the layer's weights."""
    from kvyard.bench import gpu_gemv
    from kvyard.bench.gpu_quant import layer_params
    from kvyard.bench.gpu_step import config_8b

    cfg = config_8b()
    prods = {p.name: p for p in gpu_gemv.products(cfg)}
    assert prods["gate_up"].n_out() == cfg.intermediate_size and prods["down"].k == cfg.intermediate_size
    per_layer = (layer_params(cfg) - cfg.vocab_size * cfg.hidden_size) // cfg.num_layers
    assert sum(gpu_gemv.code_bytes(p) for p in prods.values()) == per_layer
    if not torch.cuda.is_available():
        assert gpu_gemv.main(["--out", os.devnull]) == 2


def test_kv_dtypes_follow_the_engine_config() -> None:
    from dataclasses import fields

    from kvyard.workers.engine.config import EngineConfig

    has = "kv_cache_dtype" in {f.name for f in fields(EngineConfig)}
    assert kv_dtypes_available() == (("auto", "int8", "fp8") if has else ("auto",))


def test_api_logprobs_are_the_quantized_models(tmp_path, tok) -> None:
    from kvyard.workers.model import load_model

    w = start_worker(["--model", "demo", "--dtype", "float32", "--quantization", "int8", "--max-model-len", "512",
                      "--kv-cache-memory-bytes", "32MiB", "--num-threads", "1", "--served-model-name", "demo"],
                     tmp_path / "worker.log", env={k: v for k, v in os.environ.items() if k != "POD_IP"})
    try:
        window = text_windows(tok, 48, 1)
        ppl = api_perplexity(w.base_url, "demo", window)
        score = api_multiple_choice(w.base_url, "demo", tok, mc_items()[:4])
    finally:
        assert w.stop() == 0
    model, cfg = load_model(resolve_model("demo"), torch.float32, 512, quantization="int8")
    lp = window_logprobs(model, cfg, window[0])
    ids = torch.tensor(window[0][1:])
    want = math.exp(-float(lp[:-1].gather(1, ids[:, None]).mean()))
    assert ppl == pytest.approx(want, rel=1e-3)
    assert score.n == 4 and 0.0 <= score.acc <= 1.0 and 0.0 <= score.acc_norm <= 1.0
    from kvyard.workers.model.quant.apply import weight_bytes

    layers = sum(weight_bytes(getattr(lw, n)) for lw in model.layers for n in ("qkv", "o", "gate", "up", "down"))
    params = gpu_quant.layer_params(cfg) - cfg.vocab_size * cfg.hidden_size
    assert params < layers < 0.3 * 4 * params  # int8 codes + scales: a byte and a bit a weight, not float32's 4
    assert model_bytes(model) > layers
