"""Prefill graphs' padding (workers/engine/cuda_prefill.py), without a GPU.

A graph replays the step padded to its bucket: rows past the sequence's n new tokens belong to
no sequence (query_start_loc [0, n], max_query_len = the bucket). The prefill kernel must give
the real rows exactly what the unpadded launch gives, whatever the padding rows hold. Under
TRITON_INTERPRET=1 on the CPU (the attention tests' set-up), on CUDA as is.
"""
from __future__ import annotations

import torch

from .test_triton_attention import CUDA  # sets TRITON_INTERPRET and patches the interpreter first
from kvyard.workers.attention.triton_prefill import PrefillConfig, paged_prefill  # noqa: E402
from kvyard.workers.engine.cuda_prefill import prefill_buckets  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def test_buckets_double_up_to_the_step_budget() -> None:
    assert prefill_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]


def test_padded_prefill_rows_equal_the_unpadded_launch() -> None:
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, hd, bs, blocks = 4, 2, 16, 4, 16
    prefix, n, bucket = 9, 13, 32
    cache = torch.randn(2, blocks, bs, kv_heads, hd, generator=g).to(DEV)
    table = torch.randperm(blocks, generator=g)[: -(-(prefix + n) // bs)].to(torch.int32).view(1, -1).to(DEV)
    lens = torch.tensor([prefix + n], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    cfg = PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)  # tiles past n exist
    q = torch.randn(bucket, heads, hd, generator=g).to(DEV)
    q[n:] = float("nan")  # padding rows may hold anything
    padded = paged_prefill(q, cache, table, qsl, lens, hd ** -0.5, max_query_len=bucket,
                           out=torch.full_like(q, 7.0), config=cfg)
    alone = paged_prefill(q[:n].contiguous(), cache, table, qsl, lens, hd ** -0.5, max_query_len=n, config=cfg)
    assert torch.equal(padded[:n], alone)
    assert torch.all(padded[n:] == 7.0)  # the padding rows are never written
