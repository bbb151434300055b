"""LoRA on CUDA (skipped without a GPU): the engine with adapters on the GPU gives the
same greedy tokens as on the CPU (float32, adapters and the base mixed in one batch), and
the SGMV kernel is what runs there."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_gpu_engine_with_adapters_matches_reference():
    from kvyard.bench.gpu_lora import parity

    r = parity(max_tokens=12)
    assert r["sequences"] == 6 and r["parity"], r


def test_lora_decode_steps_replay_cuda_graphs():
    """With graphs on, adapter decode steps replay LoRA graphs and the tokens stay the reference's."""
    from kvyard.bench.gpu_lora import parity

    r = parity(max_tokens=12, eager=False)
    assert r["parity"] and r["lora_graphs"] > 0, r


def test_cuda_batch_uses_the_triton_tiles():
    from kvyard.workers.lora.batch import LoRABatch

    b = LoRABatch.build([0, -1, 1, 0], [], frozenset({"qkv"}), 2, torch.device("cuda"))
    assert b.tiles is not None and b.tiles.tile_len.sum().item() == 3
