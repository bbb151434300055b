"""Device selection, KV sizing and decode-graph sizes: the CUDA runner's host-side rules, on any machine."""
from __future__ import annotations

import argparse

import pytest
import torch

from kvyard.workers.engine.config import EngineConfig, add_device_arguments, device_options
from kvyard.workers.engine.cuda_runner import graph_batch_sizes
from kvyard.workers.engine.model_runner import CPU_KV_CACHE_BYTES, kv_cache_bytes, resolve_device, resolve_dtype


def test_graph_batch_sizes_cover_every_batch_up_to_the_largest() -> None:
    assert graph_batch_sizes(128)[:6] == [1, 2, 4, 8, 16, 24] and graph_batch_sizes(128)[-1] == 128
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
    for m in (1, 3, 20, 128):
        sizes = graph_batch_sizes(m)
        assert all(any(s >= b for s in sizes) for b in range(1, m + 1))


def test_device_and_dtype_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float32", "cuda") == torch.float32


def test_kv_cache_size_defaults() -> None:
    assert kv_cache_bytes(EngineConfig(), torch.device("cpu")) == CPU_KV_CACHE_BYTES
    assert kv_cache_bytes(EngineConfig(kv_cache_memory_bytes=3 << 20), torch.device("cpu")) == 3 << 20


def test_device_flags() -> None:
    p = argparse.ArgumentParser()
    add_device_arguments(p)
    opts = device_options(p.parse_args(["--device", "cuda", "--gpu-memory-utilization", "0.8", "--enforce-eager"]))
    assert opts == {"device": "cuda", "gpu_memory_utilization": 0.8, "enforce_eager": True}
    assert device_options(p.parse_args([])) == {"device": "auto", "gpu_memory_utilization": 0.9,
                                               "enforce_eager": False}
