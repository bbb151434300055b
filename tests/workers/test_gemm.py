"""workers/cpu_ops/gemm.c against a float64 reference: every epilogue, both dtypes,
ragged shapes (N not a multiple of the 64-column tile, M not a multiple of the
6-row block, strided x), and the model built on it against the torch path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvyard.common.models import resolve_model
from kvyard.workers import cpu_ops
from kvyard.workers.attention.reference import SeqStep, build_metadata
from kvyard.workers.model import kv_cache_shape, load_model

OPS = cpu_ops.load()


def _need(dtype: torch.dtype) -> cpu_ops.CpuOps:
    if OPS is None or not OPS.has_gemm(dtype):
        pytest.skip(f"no gemm.c fast path for {dtype} on this CPU")
    return OPS


def _ref(x, w, bias, other, epi):
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    if epi == cpu_ops.EPI_ADD:
        y = y + other.double()
    elif epi == cpu_ops.EPI_MUL:
        y = y * other.double()
    elif epi == cpu_ops.EPI_SILU:
        y = F.silu(y)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (5, 100, 66), (6, 960, 576), (13, 576, 1536), (32, 1536, 576),
                                   (70, 200, 130), (257, 48, 64)])
@pytest.mark.parametrize("epi", [cpu_ops.EPI_NONE, cpu_ops.EPI_ADD, cpu_ops.EPI_MUL, cpu_ops.EPI_SILU])
def test_gemm_matches_reference(dtype, m, n, k, epi) -> None:
    ops = _need(dtype)
    g = torch.Generator().manual_seed(m * 7 + n + k + epi)
    w = torch.randn(n, k, generator=g).to(dtype)
    xs = torch.randn(m, k + 8, generator=g).to(dtype)[:, 3:3 + k]  # a strided view: rows not contiguous
    bias = torch.randn(n, generator=g).to(dtype) if epi != cpu_ops.EPI_MUL else None
    other = torch.randn(m, n, generator=g).to(dtype) if epi in (cpu_ops.EPI_ADD, cpu_ops.EPI_MUL) else None
    got = ops.gemm(xs, cpu_ops.GemmWeight.pack(w), bias, other, epi)
    want = _ref(xs, w, bias, other, epi)
    assert got.shape == (m, n) and got.dtype == dtype
    scale = want.abs().max().item() + 1
    # float32: only the summation order differs; bf16: one rounding of the result (2^-8 relative)
    tol = 1e-5 * scale if dtype == torch.float32 else 2 ** -7 * scale
    assert (got.double() - want).abs().max().item() < tol


def test_gemm_rejects_bad_operands_and_handles_empty() -> None:
    ops = _need(torch.float32)
    w = cpu_ops.GemmWeight.pack(torch.randn(64, 32))
    assert ops.gemm(torch.empty(0, 32), w).shape == (0, 64)
    with pytest.raises(ValueError):
        ops.gemm(torch.randn(2, 31), w)  # wrong K
    with pytest.raises(ValueError):
        ops.gemm(torch.randn(2, 32), w, other=None, epi=cpu_ops.EPI_ADD)  # missing operand
    with pytest.raises(ValueError):
        ops.gemm(torch.randn(2, 32).to(torch.bfloat16), w)  # dtype mismatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_on_gemm_matches_torch_path(dtype) -> None:
    """The whole decoder on gemm.c against the same weights on torch's ops: a prefill
    of 40 tokens and a 1-token decode; float32 to summation order, bf16 to rounding."""
    _need(dtype)
    tiled, cfg = load_model(resolve_model("demo"), dtype)
    plain, _ = load_model(resolve_model("demo"), dtype, cpu_kernels=False)
    assert tiled.gemm is not None and plain.gemm is None
    ids = torch.randint(0, cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (tiled, plain):
        caches = [torch.zeros(kv_cache_shape(cfg, 4, 16), dtype=dtype) for _ in range(cfg.num_layers)]
        with torch.inference_mode():
            meta = build_metadata([SeqStep([2, 0, 3], 0, 40)], 16, 0)
            a = model.compute_logits(model(ids[:40], torch.arange(40), caches, meta))
            meta = build_metadata([SeqStep([2, 0, 3], 40, 1)], 16, 1)
            b = model.compute_logits(model(ids[40:], torch.tensor([40]), caches, meta))
        outs.append(torch.cat((a, b)))
    diff = (outs[0] - outs[1]).abs().max().item()
    assert diff < (1e-3 if dtype == torch.float32 else 2.0), diff
    agree = (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean().item()
    assert agree >= (1.0 if dtype == torch.float32 else 0.9), agree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_rows_are_the_full_forwards_rows_bit_for_bit(dtype) -> None:
    """forward(out_rows=...) skips the last layer's MLP for the other rows: the kept rows
    and every K/V written to the cache are exactly those of the full forward."""
    _need(dtype)
    model, cfg = load_model(resolve_model("demo"), dtype)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    meta = build_metadata([SeqStep([2, 0, 3], 0, 40)], 16, 0)
    runs = []
    for rows in (None, torch.tensor([39, 7]), torch.tensor([], dtype=torch.int64)):
        caches = [torch.zeros(kv_cache_shape(cfg, 4, 16), dtype=dtype) for _ in range(cfg.num_layers)]
        with torch.inference_mode():
            runs.append((model(ids, torch.arange(40), caches, meta, rows), caches))
    (full, c0), (two, c1), (none, c2) = runs
    assert torch.equal(two, full[[39, 7]]) and none.shape == (0, cfg.hidden_size)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(c0, c1, c2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_tiles_hold_the_dequantized_weights_exactly(dtype) -> None:
    """GGUF-block tiles (Q4_0, Q4_1, Q8_0) expand to exactly the loader's dense weights:
    x = I makes y = W^T, element for element (float32 bit-identical; bf16 the same RNE)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quantize

    from kvyard.workers.model.gguf_file import dequantize, quant_parts

    ops = _need(dtype)
    n, k = 100, 96  # N not a multiple of the tile; 3 blocks of 32 along K
    w = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raw = torch.from_numpy(np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(-1))
        dense = dequantize(raw, qtype, (n, k)).to(dtype)
        codes, d, m, bits, off = quant_parts(raw, qtype, (n, k))
        tiles = cpu_ops.GemmWeight.pack_quant(codes, d, m, bits, off, dtype)
        got = ops.gemm(torch.eye(k, dtype=dtype), tiles)
        assert torch.equal(got.t(), dense), qtype
        for j in (0, 37, k - 1):  # one row: float32 expands in registers instead (another path)
            assert torch.equal(ops.gemm(torch.eye(k, dtype=dtype)[j:j + 1], tiles)[0], dense[:, j]), (qtype, j)
        for rows in (8, 11):  # float32: in registers too, in balanced blocks (4 + 4, 6 + 5)
            got = ops.gemm(torch.eye(k, dtype=dtype)[10:10 + rows], tiles)
            assert torch.equal(got.t(), dense[:, 10:10 + rows]), (qtype, rows)
        # and a real product, rows in several register blocks, with an epilogue
        for rows in (13, 5):
            x = torch.randn(rows, k).to(dtype)
            other = torch.randn(rows, n).to(dtype)
            want = _ref(x, dense, None, other, cpu_ops.EPI_ADD)
            got = ops.gemm(x, tiles, None, other, cpu_ops.EPI_ADD).double()
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7
            assert (got - want).abs().max().item() < tol * (want.abs().max().item() + 1)


def test_demo_model_uses_quantized_tiles() -> None:
    """The demo GGUF (Q4_1 layers, Q8_0 embeddings) loads straight into quantized tiles."""
    _need(torch.float32)
    model, _ = load_model(resolve_model("demo"), torch.float32)
    lw = model.layers[0]
    assert all(isinstance(t, cpu_ops.GemmWeight) and t.bits == 4 for t in (lw.qkv, lw.o, lw.gate, lw.up, lw.down))
    assert isinstance(model.lm_head, cpu_ops.GemmWeight) and model.lm_head.bits == 8


def test_thread_team_survives_concurrent_callers_and_fork() -> None:
    """pool.c: a second caller while the team is busy runs on its own thread, and a
    forked child (its helpers gone) still computes, instead of waiting forever."""
    import multiprocessing
    import threading

    ops = _need(torch.float32)
    w = torch.randn(640, 256)
    gw = cpu_ops.GemmWeight.pack(w)
    xs = [torch.randn(32, 256) for _ in range(4)]
    want = [x @ w.t() for x in xs]
    got: dict[int, list[torch.Tensor]] = {}

    def work(i: int) -> None:
        got[i] = [ops.gemm(xs[i], gw) for _ in range(50)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i in range(4):
        assert all((g - want[i]).abs().max().item() < 1e-3 for g in got[i])

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        res = pool.apply_async(_child_gemm, (xs[0], gw, want[0]))
        assert res.get(timeout=120) < 1e-3


def _child_gemm(x: torch.Tensor, gw: cpu_ops.GemmWeight, want: torch.Tensor) -> float:
    # only our kernel and small torch ops here: torch's own OpenMP pool hangs after fork
    ops = cpu_ops.load()
    assert ops is not None
    return (ops.gemm(x, gw) - want).abs().max().item()
