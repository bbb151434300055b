"""The CPU paged-attention backend against the dense reference on a mixed batch."""
from __future__ import annotations

import pytest
import torch

from kvyard.workers import cpu_ops as cpu_kernel
from kvyard.workers.attention import AttentionMetadata
from kvyard.workers.attention.reference import SeqStep, build_metadata, dense_attention
from kvyard.workers.attention.torch_cpu import TorchCPUBackend

BS, NKV, NH, HD = 4, 2, 6, 16


def _run(dtype: torch.dtype, seqs: list[SeqStep], num_decodes: int, layers: int = 2,
         all_heads: bool = True, kernel: bool = False):
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
    backend = TorchCPUBackend(all_heads_max_kv=NKV if all_heads else 0, kernel=kernel)
    assert (backend.kernel is not None) == kernel
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


@pytest.mark.parametrize("path", ["all-heads", "head-major", "c-kernel"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mixed_batch_matches_dense_reference(dtype: torch.dtype, tol: float, path: str) -> None:
    cache, meta, q, ctx_k, ctx_v, outs = _run(dtype, SEQS, num_decodes=3, all_heads=path == "all-heads",
                                              kernel=path == "c-kernel")
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


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c-kernel"])
def test_decode_only_and_prefill_only_batches(kernel: bool) -> None:
    dec = [SeqStep([2, 0], 5, 1), SeqStep([1], 3, 1)]
    pre = [SeqStep([0, 1, 2], 0, 9)]
    for seqs, nd in ((dec, 2), (pre, 0)):
        _, meta, q, ctx_k, ctx_v, outs = _run(torch.float32, seqs, nd, layers=1, kernel=kernel)
        qsl = meta.query_start_loc
        for i, s in enumerate(seqs):
            want = dense_attention(q[qsl[i]:qsl[i + 1]], ctx_k[i], ctx_v[i], s.num_cached, HD ** -0.5)
            torch.testing.assert_close(outs[0][qsl[i]:qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_metadata_rejects_multi_token_decode() -> None:
    with pytest.raises(ValueError):
        build_metadata([SeqStep([0], 0, 2)], BS, num_decodes=1)
    assert isinstance(build_metadata([SeqStep([0], 0, 2)], BS, 0), AttentionMetadata)


def test_decode_kernel_builds_here() -> None:
    """CI installs a C compiler: the fast path must be the one the tests exercise."""
    k = cpu_kernel.load()
    assert k is not None and k.supports(torch.bfloat16) and k.supports(torch.float32)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_long_contexts_and_big_heads(dtype: torch.dtype, portable: bool) -> None:
    """Context lengths off block boundaries, 8 KV heads x group 4, head_dim 128,
    block tables wider than needed, and a q with a token stride (a view of qkv);
    both the build for this CPU and the portable (no AVX-512) one."""
    k = cpu_kernel.load(portable)
    assert k is not None and (k.isa == "portable") == portable
    g = torch.Generator().manual_seed(1)
    nkv, grp, hd, bs, nb = 8, 4, 128, 16, 4 * 36
    lens = [1, 17, 300, 513]
    cache = torch.randn(2, nb, bs, nkv, hd, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[i * 36:(i + 1) * 36] for i in range(4)]).to(torch.int64)
    qkv = torch.randn(len(lens), nkv * grp + 2 * nkv, hd, generator=g).to(dtype)
    q = qkv[:, :nkv * grp]
    out = torch.empty(len(lens), nkv * grp, hd, dtype=dtype)
    k.attend(q, cache, tables, torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
             max(lens), hd ** -0.5, out)
    for i, L in enumerate(lens):
        slots = (tables[i][:, None] * bs + torch.arange(bs)).reshape(-1)[:L]
        kk = cache[0].reshape(-1, nkv, hd)[slots]
        vv = cache[1].reshape(-1, nkv, hd)[slots]
        want = dense_attention(q[i:i + 1], kk, vv, L - 1, hd ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out[i].float() - want[0].float()).abs().max().item() < tol, f"sequence {i}"


@pytest.mark.parametrize("hd,nkv,grp", [(64, 3, 3), (128, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_prefill_tiles_match_reference(dtype: torch.dtype, hd: int, nkv: int, grp: int) -> None:
    """Prefill chunks go through the tiled path (runs of a sequence's consecutive
    queries): after a cached prefix, off block and tile boundaries, more than one
    tile per sequence, next to decodes and a one-token chunk (per-query path). Each
    query's output matches the dense reference, and the same query run alone (the
    per-query path) to within rounding: in float32 only q.k's summation order
    differs (the HF parity tests check the tokens)."""
    k = cpu_kernel.load()
    g = torch.Generator().manual_seed(2)
    bs, nb = 16, 64
    cache = torch.randn(2, nb, bs, nkv, hd, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[i * 16:(i + 1) * 16] for i in range(4)]).to(torch.int64)
    # (table row, context length of each query): a decode, a 45-token chunk after 37
    # cached tokens, a 20-token chunk from scratch, a one-token chunk
    runs = [(0, [120]), (1, list(range(38, 83))), (2, list(range(1, 21))), (3, [9])]
    rows = torch.tensor([r for r, lens in runs for _ in lens], dtype=torch.int32)
    lens = torch.tensor([x for _, ls in runs for x in ls], dtype=torch.int32)
    n = len(lens)
    q = torch.randn(n, nkv * grp, hd, generator=g).to(dtype)
    out = torch.empty(n, nkv * grp, hd, dtype=dtype)
    k.attend(q, cache, tables, rows, lens, int(lens.max()), hd ** -0.5, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(n):
        L, r = int(lens[i]), int(rows[i])
        slots = (tables[r][:, None] * bs + torch.arange(bs)).reshape(-1)[:L]
        kk = cache[0].reshape(-1, nkv, hd)[slots]
        vv = cache[1].reshape(-1, nkv, hd)[slots]
        want = dense_attention(q[i:i + 1], kk, vv, L - 1, hd ** -0.5)
        assert (out[i].float() - want[0].float()).abs().max().item() < tol, f"query {i}"
        alone = torch.empty(1, nkv * grp, hd, dtype=dtype)
        k.attend(q[i:i + 1], cache, tables, rows[i:i + 1], lens[i:i + 1], L, hd ** -0.5, alone)
        assert (out[i].float() - alone[0].float()).abs().max().item() < tol, f"query {i} vs per-query"


def test_float32_tiles_need_no_avx512_bf16(tmp_path) -> None:
    """AVX-512 CPUs without BF16 (Skylake/Cascade Lake servers, where `--dtype auto` is
    float32) get the same float32 prefill tiles: a build with -mno-avx512bf16 gives
    bit-identical outputs to this machine's native build."""
    import shutil
    import subprocess

    native = cpu_kernel.load()
    cc = shutil.which("cc") or shutil.which("gcc")
    if native is None or cc is None or native.isa != "avx512+avx512bf16":
        pytest.skip("needs a compiler and an AVX512-BF16 CPU to compare against")
    so = tmp_path / "nobf16.so"
    subprocess.run([cc, *cpu_kernel._FLAGS, "-mno-avx512bf16", *map(str, cpu_kernel._SRCS), "-o", str(so), "-lm"],
                   check=True, capture_output=True, timeout=120)
    plain = cpu_kernel.CpuOps(so)
    assert plain.isa == "avx512"
    g = torch.Generator().manual_seed(5)
    bs, nb, nkv, grp, hd = 16, 32, 3, 3, 64
    cache = torch.randn(2, nb, bs, nkv, hd, generator=g)
    tables = torch.randperm(nb, generator=g).view(2, 16).to(torch.int64)
    runs = [(0, list(range(30, 70))), (1, list(range(1, 34)))]  # after a cached prefix; from scratch
    rows = torch.tensor([r for r, lens in runs for _ in lens], dtype=torch.int32)
    lens = torch.tensor([x for _, ls in runs for x in ls], dtype=torch.int32)
    q = torch.randn(len(lens), nkv * grp, hd, generator=g)
    a, b = torch.empty_like(q), torch.empty_like(q)
    native.attend(q, cache, tables, rows, lens, int(lens.max()), hd ** -0.5, a)
    plain.attend(q, cache, tables, rows, lens, int(lens.max()), hd ** -0.5, b)
    assert torch.equal(a, b)
    for i in (0, 39, 40, len(lens) - 1):
        r, L = int(rows[i]), int(lens[i])
        slots = (tables[r][:, None] * bs + torch.arange(bs)).reshape(-1)[:L]
        want = dense_attention(q[i:i + 1], cache[0].reshape(-1, nkv, hd)[slots],
                               cache[1].reshape(-1, nkv, hd)[slots], L - 1, hd ** -0.5)
        assert (b[i] - want[0]).abs().max().item() < 1e-5, i
