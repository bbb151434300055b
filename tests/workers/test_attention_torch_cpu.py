"""The CPU paged-attention backend against the dense reference on a mixed batch."""
from __future__ import annotations

import pytest
import torch

from kvyard.workers.attention import AttentionMetadata
from kvyard.workers.attention.reference import SeqStep, build_metadata, dense_attention
from kvyard.workers.attention.torch_cpu import TorchCPUBackend

BS, NKV, NH, HD = 4, 2, 6, 16


def _run(dtype: torch.dtype, seqs: list[SeqStep], num_decodes: int, layers: int = 2,
         all_heads: bool = True):
    g = torch.Generator().manual_seed(0)
    num_blocks = 1 + max(b for s in seqs for b in s.block_ids)
    # Garbage everywhere: any read of an unwritten or padded slot shows up in the output.
    cache = (torch.randn(2, num_blocks, BS, NKV, HD, generator=g) * 50).to(dtype)
    ctx_k, ctx_v = [], []
    for s in seqs:
        L = s.num_cached + s.num_new
        k, v = torch.randn(2, L, NKV, HD, generator=g).to(dtype)
        for pos in range(s.num_cached):  # the prefix an earlier step wrote
            cache[0, s.block_ids[pos // BS], pos % BS] = k[pos]
            cache[1, s.block_ids[pos // BS], pos % BS] = v[pos]
        ctx_k.append(k)
        ctx_v.append(v)
    meta = build_metadata(seqs, BS, num_decodes)
    q = torch.randn(meta.query_start_loc[-1], NH, HD, generator=g).to(dtype)
    new_k = torch.cat([k[s.num_cached:] for s, k in zip(seqs, ctx_k)])
    new_v = torch.cat([v[s.num_cached:] for s, v in zip(seqs, ctx_v)])
    backend = TorchCPUBackend(all_heads_max_kv=NKV if all_heads else 0)
    with torch.inference_mode():
        outs = [backend.forward(q, new_k, new_v, cache, meta, HD ** -0.5) for _ in range(layers)]
    return cache, meta, q, ctx_k, ctx_v, outs


SEQS = [  # 3 decodes, then prefill chunks: after a cached prefix, fresh, and block-aligned
    SeqStep([5], 0, 1),
    SeqStep([9, 2, 11, 0, 7], 17, 1),
    SeqStep([3, 14], 7, 1),
    SeqStep([12, 1, 8, 16, 4, 6], 9, 13),
    SeqStep([10, 13, 15], 0, 10),
    SeqStep([17, 18, 19], 8, 1),
]


@pytest.mark.parametrize("all_heads", [True, False], ids=["all-heads", "head-major"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mixed_batch_matches_dense_reference(dtype: torch.dtype, tol: float, all_heads: bool) -> None:
    cache, meta, q, ctx_k, ctx_v, outs = _run(dtype, SEQS, num_decodes=3, all_heads=all_heads)
    assert len(meta.scratch) == 1, "the step plan is built once and reused by later layers"
    assert torch.equal(outs[0], outs[1])
    qsl = meta.query_start_loc
    for i, s in enumerate(SEQS):
        want = dense_attention(q[qsl[i]:qsl[i + 1]], ctx_k[i], ctx_v[i], s.num_cached, HD ** -0.5)
        got = outs[0][qsl[i]:qsl[i + 1]]
        assert (got.float() - want.float()).abs().max().item() < tol, f"sequence {i}"
        for pos in range(s.num_cached, s.num_cached + s.num_new):  # new K/V landed in their slots
            b, off = s.block_ids[pos // BS], pos % BS
            assert torch.equal(cache[0, b, off], ctx_k[i][pos])
            assert torch.equal(cache[1, b, off], ctx_v[i][pos])


def test_decode_only_and_prefill_only_batches() -> None:
    dec = [SeqStep([2, 0], 5, 1), SeqStep([1], 3, 1)]
    pre = [SeqStep([0, 1, 2], 0, 9)]
    for seqs, nd in ((dec, 2), (pre, 0)):
        _, meta, q, ctx_k, ctx_v, outs = _run(torch.float32, seqs, nd, layers=1)
        qsl = meta.query_start_loc
        for i, s in enumerate(seqs):
            want = dense_attention(q[qsl[i]:qsl[i + 1]], ctx_k[i], ctx_v[i], s.num_cached, HD ** -0.5)
            torch.testing.assert_close(outs[0][qsl[i]:qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_metadata_rejects_multi_token_decode() -> None:
    with pytest.raises(ValueError):
        build_metadata([SeqStep([0], 0, 2)], BS, num_decodes=1)
    assert isinstance(build_metadata([SeqStep([0], 0, 2)], BS, 0), AttentionMetadata)
