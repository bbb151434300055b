"""Level-2 wake's reload (engine/fast_reload.py) on the CPU: the staged shards give every
tensor safetensors itself gives (several shards, pieces smaller than a tensor, odd sizes),
and the model built over them equals the loader's."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvyard.workers.engine.fast_reload import PinnedRing, StagedSource, read_header, reload_hf, shard_files
from kvyard.workers.engine.sleep_mode import _tensors


def test_staged_source_equals_safetensors(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    a = {"x": torch.randn(33, 7, generator=g), "y": torch.randint(0, 9, (5,), dtype=torch.int64),
         "z": torch.randn(3, dtype=torch.float64)}
    b = {"w": torch.randn(1001, generator=g).to(torch.bfloat16), "u": torch.arange(3, dtype=torch.uint8),
         "v": torch.randn(17, 3, generator=g).to(torch.float16)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}}))
    files = shard_files(tmp_path)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(read_header(files[0])[1]) == set(a)
    with torch.inference_mode():           # as in a wake: the staging is an inference tensor
        src = StagedSource.from_files(files, torch.device("cpu"), PinnedRing(threads=3, slot=100))
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                assert src.has(name)
                got, want = src.get(name), h.get_tensor(name)
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert not src.has("nope") and src.get_int4("x") is None and src.get_quant("x") is None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-reload")
    LlamaForCausalLM(cfg).float().save_pretrained(d, safe_serialization=True)
    return d


def test_reload_builds_the_loaders_model(tiny_dir) -> None:
    from kvyard.common.models import resolve_model
    from kvyard.workers.model import load_model

    want, _ = load_model(resolve_model(str(tiny_dir)), torch.float32, 512)
    parts: dict[str, float] = {}
    got = reload_hf(tiny_dir, torch.float32, 512, torch.device("cpu"), PinnedRing(threads=2, slot=4096), parts)
    assert parts["read_s"] >= 0 and parts["build_s"] >= 0
    a, b = _tensors(want), _tensors(got)
    assert len(a) == len(b) and len(a) > 10
    compared = 0
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        try:
            x.untyped_storage(), y.untyped_storage()
        except (NotImplementedError, RuntimeError):   # opaque packed tiles: no elementwise view
            continue
        assert torch.equal(x, y)
        compared += 1
    assert compared > 10
