"""The Triton kernels over int8 / fp8 KV caches (kv_quant.py's row format).

Without a GPU they run under TRITON_INTERPRET=1 (the setup of test_triton_attention.py,
imported from there). The KV write must produce kv_quant.quantize's bytes exactly;
decode and prefill are checked against a float64 reference over the *dequantized*
context, so the tolerances bound the kernels' arithmetic, not the quantization error.
"""
from __future__ import annotations

import pytest
import torch

from .test_triton_attention import CUDA, DEV, DTYPES, TOL, _Batch, _poisoned, _rel  # sets TRITON_INTERPRET first

from kvyard.workers.attention import kv_quant  # noqa: E402
from kvyard.workers.attention.reference import SeqStep, build_metadata  # noqa: E402
from kvyard.workers.attention.triton_backend import TritonBackend  # noqa: E402
from kvyard.workers.attention.triton_decode import DecodeConfig, paged_decode  # noqa: E402
from kvyard.workers.attention.triton_kv_write import rope_write_kv, write_kv  # noqa: E402
from kvyard.workers.attention.triton_prefill import PrefillConfig, paged_prefill  # noqa: E402

FORMATS = [kv_quant.INT8, kv_quant.FP8, kv_quant.FP8_E4M3]


def _quantized(batch: _Batch, fmt: kv_quant.KVFormat) -> torch.Tensor:
    """batch's cache as a quantized cache: cached prefixes quantized in place, the rest garbage."""
    _, nb, bs, nkv, hd = batch.cache.shape
    cache = torch.randint(-128, 127, kv_quant.cache_shape((2, nb, bs, nkv, hd), fmt), dtype=torch.int8)
    cache = cache.view(fmt.dtype)
    slots = torch.tensor([b[p // bs] * bs + p % bs for b, (c, _) in zip(batch.block_ids, batch.specs)
                          for p in range(c)], dtype=torch.int64)
    k = torch.cat([kv[0, :c] for kv, (c, _) in zip(batch.ctx, batch.specs)])
    v = torch.cat([kv[1, :c] for kv, (c, _) in zip(batch.ctx, batch.specs)])
    kv_quant.write(cache, k, v, slots)
    return cache.to(DEV)


def _dequantized_context(batch: _Batch, fmt: kv_quant.KVFormat) -> None:
    """The reference's context becomes what the cache holds: quantize-dequantize each row."""
    batch.ctx = [kv_quant.dequantize(kv_quant.quantize(kv, fmt).view(fmt.dtype)).to(kv.dtype) for kv in batch.ctx]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_is_kv_quant_bit_for_bit(fmt: kv_quant.KVFormat, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    nkv, hd, T = 3, 64, 11
    cache = torch.zeros(kv_quant.cache_shape((2, 4, 16, nkv, hd), fmt), dtype=torch.int8).view(fmt.dtype).to(DEV)
    k = (torch.randn(T, nkv, hd, generator=g) * 3).to(dtype)
    v = torch.randn(T, nkv, hd, generator=g).to(dtype)
    k[2, 1] = 0.0                        # an all-zero row: scale 0, codes 0
    v[3, 0, :5] = torch.tensor([1e-3, -1e-4, 2.0, -0.0, 7e-3])   # subnormal fp8 codes
    slots = torch.randperm(64, generator=g)[:T]
    slots[4] = -1
    want = torch.zeros_like(cache.cpu())
    kv_quant.write(want, k, v, slots)
    write_kv(k.to(DEV), v.to(DEV), cache, slots.to(DEV))
    assert torch.equal(cache.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_rope_write_quantizes_the_rotated_k(fmt: kv_quant.KVFormat) -> None:
    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(9)
    nkv, nh, hd, T = 2, 4, 64, 7
    cache = torch.zeros(kv_quant.cache_shape((2, 3, 16, nkv, hd), fmt), dtype=torch.int8).view(fmt.dtype).to(DEV)
    q = torch.randn(T, nh, hd, generator=g).to(dtype)
    k = torch.randn(T, nkv, hd, generator=g).to(dtype)
    v = torch.randn(T, nkv, hd, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 9, 1, 30, 2, 5])
    ang = pos.double()[:, None] / 10000 ** (torch.arange(0, hd, 2).double() / hd)
    cos_t, sin_t = torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)
    table = torch.zeros(31, hd // 2, dtype=dtype)
    stable = torch.zeros(31, hd // 2, dtype=dtype)
    table[pos], stable[pos] = cos_t, sin_t
    slots = torch.arange(T) * 5
    q_dev = q.clone().to(DEV)
    rope_write_kv(q_dev, k.to(DEV), v.to(DEV), cache, slots.to(DEV), pos.to(DEV), table.to(DEV), stable.to(DEV))
    cos_full = torch.cat((table[pos], table[pos]), -1).float()[:, None]
    sin_full = torch.cat((stable[pos], stable[pos]), -1).float()[:, None]
    half = hd // 2
    kf = k.float()
    k_rot = (kf * cos_full + torch.cat((-kf[..., half:], kf[..., :half]), -1) * sin_full).to(dtype)
    want = torch.zeros_like(cache.cpu())
    kv_quant.write(want, k_rot, v, slots)
    got = cache.cpu().view(torch.uint8)
    # the rotation's float32 rounding may differ in the last bit from torch's: compare dequantized
    deq = kv_quant.dequantize(got.view(fmt.dtype)[:, slots // 16, slots % 16].clone())
    ref = kv_quant.dequantize(want[:, slots // 16, slots % 16].clone())
    step = ref.abs().amax(-1, keepdim=True) / fmt.qmax * (1 if fmt is kv_quant.INT8 else 32)
    assert ((deq - ref).abs() <= step + 1e-6).all()
    assert torch.equal(got[1], want.view(torch.uint8)[1]), "V is written as is"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype,splits,hd", [(DTYPES[0], 1, 64), (DTYPES[-1], 3, 64), (DTYPES[-1], 2, 128),
                                             (DTYPES[-1], 2, 32)])
def test_decode_matches_reference(fmt: kv_quant.KVFormat, dtype: torch.dtype, splits: int, hd: int) -> None:
    """head_dim >= 64: the word-loading kernel (triton_decode_quant.py); 32: the byte loads."""
    bs, nkv, gqa = 16, 2, 4
    lens = [1, 17, 2 * bs, 75]
    batch = _Batch([(n - 1, 1) for n in lens], bs, nkv, nkv * gqa, hd, dtype, seed=splits + 11)
    _dequantized_context(batch, fmt)
    cache = _quantized(batch, fmt)
    k, v = batch.new_kv()
    write_kv(k, v, cache, batch.slots())
    out = paged_decode(batch.q, cache, batch.tables(), batch.lens(), hd ** -0.5, out=_poisoned(batch.q),
                       config=DecodeConfig(num_splits=splits, block_n=64 if CUDA else 16))
    assert torch.isfinite(out).all()
    assert _rel(out, batch.reference(hd ** -0.5)) < 2 * TOL[dtype]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES[-1:])
def test_prefill_matches_reference(fmt: kv_quant.KVFormat, dtype: torch.dtype) -> None:
    bs, nkv, gqa, hd = 16, 2, 4, 64
    batch = _Batch([(0, 21), (20, 5), (32, 3), (45, 1)], bs, nkv, nkv * gqa, hd, dtype, seed=21)
    _dequantized_context(batch, fmt)
    cache = _quantized(batch, fmt)
    k, v = batch.new_kv()
    write_kv(k, v, cache, batch.slots())
    cfg = None if CUDA else PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    out = paged_prefill(batch.q, cache, batch.tables(torch.int64), batch.query_start(), batch.lens(), hd ** -0.5,
                        max_query_len=21, out=_poisoned(batch.q), config=cfg)
    assert torch.isfinite(out).all()
    assert _rel(out, batch.reference(hd ** -0.5)) < 2 * TOL[dtype]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, DTYPES[-1]])
def test_short_extends_over_cached_prefixes(fmt: kv_quant.KVFormat, dtype: torch.dtype) -> None:
    """A prefix-cache hit's step: a few new tokens per sequence over long quantized prefixes, in
    prefill_config's short-query tiles (what the engine launches for it)."""
    from kvyard.workers.attention.triton_prefill import prefill_config

    bs, nkv, gqa, hd = 16, 3, 3, 64   # the demo model's attention shape
    batch = _Batch([(48, 3), (80, 1), (33, 15), (64, 16)], bs, nkv, nkv * gqa, hd, dtype, seed=5)
    _dequantized_context(batch, fmt)
    cache = _quantized(batch, fmt)
    k, v = batch.new_kv()
    write_kv(k, v, cache, batch.slots())
    out = paged_prefill(batch.q, cache, batch.tables(torch.int64), batch.query_start(), batch.lens(), hd ** -0.5,
                        max_query_len=16, out=_poisoned(batch.q), config=prefill_config(hd, 16))
    assert torch.isfinite(out).all()
    assert _rel(out, batch.reference(hd ** -0.5)) < 2 * TOL[dtype]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_backend_mixed_batch_matches_cpu_reference(fmt: kv_quant.KVFormat) -> None:
    """Decodes and prefill chunks through TritonBackend against kv_quant.attend (the CPU
    definition) on the same quantized cache."""
    dtype = DTYPES[0]
    specs = [(0, 1), (17, 1), (9, 13), (0, 10)]
    batch = _Batch(specs, 16, 2, 8, 64, dtype, seed=7)
    cache = _quantized(batch, fmt)
    meta = build_metadata([SeqStep(b, c, n) for b, (c, n) in zip(batch.block_ids, specs)], 16, num_decodes=2)
    k, v = batch.new_kv()
    out = TritonBackend().forward(batch.q, k, v, cache, meta, 0.125)
    ref = kv_quant.attend(batch.q.cpu().float(), cache.cpu(), meta.query_start_loc, meta.seq_lens,
                          meta.block_tables, 0.125)
    assert _rel(out, ref.double()) < 2 * TOL[dtype]
