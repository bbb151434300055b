"""workers/model/weight_cache.py: a CPU model built once comes back memory-mapped with
every packed weight bit-identical and the same greedy tokens; an unreadable file is
rebuilt over; KVYARD_WEIGHT_CACHE=0 writes nothing; another dtype is another entry."""
from __future__ import annotations

import pytest
import torch

from kvyard.common.models import resolve_model
from kvyard.workers.model import loader, weight_cache
from kvyard.workers.model.linear_ops import GemmOps


def _tensors(model) -> list[torch.Tensor]:
    return list(weight_cache._tensors(weight_cache.parts(model)))


def _greedy(model, cfg) -> list[int]:
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine

    del model, cfg  # the engine loads its own, through the same cache
    cfg32 = EngineConfig(model="demo", max_model_len=256, dtype="float32",
                         kv_cache_memory_bytes=16 << 20)
    llm = LLM(engine=LLMEngine.from_config(cfg32))
    out = llm.generate([[1, 504, 3458, 282, 4237, 314]],
                       SamplingParams(max_tokens=12, temperature=0.0))
    return out[0].token_ids


def test_a_cached_model_is_the_built_one(tmp_path, monkeypatch, demo_gguf) -> None:
    monkeypatch.setenv("KVYARD_CACHE_DIR", str(tmp_path))
    src = resolve_model("demo")
    monkeypatch.setenv("KVYARD_WEIGHT_CACHE", "0")
    fresh, cfg = loader.load_model(src, torch.float32)
    if not isinstance(fresh.ops, GemmOps):
        pytest.skip("gemm.c does not build here (no compiler or AVX-512): nothing is cached")
    assert not (tmp_path / "weights").exists()
    want = _greedy(fresh, cfg)

    monkeypatch.setenv("KVYARD_WEIGHT_CACHE", "1")
    built, _ = loader.load_model(src, torch.float32)  # builds and writes the cache
    [entry] = (tmp_path / "weights").glob("*.pt")

    def no_build(*a, **kw):
        raise AssertionError("built again despite the cache")
    monkeypatch.setattr(loader, "build", no_build)
    cached, _ = loader.load_model(src, torch.float32)
    a, b = _tensors(fresh), _tensors(cached)
    assert len(a) == len(b) > 100
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    assert (cached.greedy is None) == (fresh.greedy is None)
    assert _greedy(cached, cfg) == want  # the engine's own load, from the cache too
    del built

    # A damaged file is rebuilt over, not fatal.
    entry.write_bytes(b"not a checkpoint")
    monkeypatch.undo()
    monkeypatch.setenv("KVYARD_CACHE_DIR", str(tmp_path))
    again, _ = loader.load_model(src, torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(_tensors(again), a))
    assert entry.stat().st_size > 1 << 20
    # Another dtype: another entry.
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        loader.load_model(src, torch.bfloat16)
        assert len(list((tmp_path / "weights").glob("*.pt"))) == 2
