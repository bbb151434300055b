"""Weight quantization (`--quantization`): the formats, gemm.c's quantized tiles, the CUDA
paths (Triton dequant-GEMMs under TRITON_INTERPRET=1 without a GPU, fp8 `_scaled_mm`) and
whole models built by the loader against the same dequantized weights on torch's ops.

References are float64 over the dequantized weights the kernels must compute with, so each
test checks the kernel, not the format's accuracy (the bench measures that).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _cuda_ops_tests():
    """test_cuda_ops.py's module: importing it sets TRITON_INTERPRET=1 without a GPU (before
    triton loads) with its interpreter fix; its tiny-model helpers are reused here."""
    spec = importlib.util.spec_from_file_location("_kvyard_cuda_ops_tests", Path(__file__).with_name("test_cuda_ops.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cuda_t = _cuda_ops_tests()

from kvyard.workers import cpu_ops  # noqa: E402
from kvyard.workers.attention.reference import SeqStep, build_metadata  # noqa: E402
from kvyard.workers.model.config import ModelConfig  # noqa: E402
from kvyard.workers.model.cuda_ops import CudaOps  # noqa: E402
from kvyard.workers.model.linear_ops import GemmOps, TorchOps  # noqa: E402
from kvyard.workers.model.loader import build, kv_cache_shape  # noqa: E402
from kvyard.workers.model.quant import dequantize, quantize, validate_method  # noqa: E402
from kvyard.workers.model.quant.apply import place  # noqa: E402
from kvyard.workers.model.quant.cuda_gemv import quantize_rows_fp8_fused  # noqa: E402
from kvyard.workers.model.quant.cuda_quant import QuantWeight, dequant_gemm, quantize_rows_fp8  # noqa: E402
from kvyard.workers.model.quant.formats import FP8_MAX  # noqa: E402

METHODS = ("int8", "fp8", "int4")
OPS = cpu_ops.load()
DEV = cuda_t.DEV


def _w(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    w[1] = 0.0  # an all-zero row: scale 1, codes 0
    w[2, :32] *= 40  # an outlier group
    return w


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


@pytest.mark.parametrize("method", METHODS)
def test_formats_round_trip(method) -> None:
    w = _w(70, 96, 1)
    p = quantize(w, method)
    deq = dequantize(p)
    assert p.codes.shape == w.shape and p.d.shape == p.m.shape == (70, 3)
    assert torch.equal(deq[1], torch.zeros(96))
    # worst case per format: half a step of the row's (int8, fp8: channel's; int4: group's) grid
    step = {"int8": w.abs().amax(1, keepdim=True) / 127, "fp8": torch.maximum(w.abs() * 2 ** -3, p.d[:, :1].float() * 2 ** -9),  # 3 mantissa bits; subnormals
            "int4": (w.view(70, 3, 32).amax(2) - w.view(70, 3, 32).amin(2)).repeat_interleave(32, 1) / 15}[method]
    assert ((deq - w).abs() <= step * 0.5 * 1.01 + 1e-6).all()
    if method == "fp8":  # the codes are torch's own E4M3 rounding of w / scale
        s = p.d[:, :1].float()
        want = (w / s).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(p.codes, want)
    assert p.nbytes < w.numel() * (1.1 if method != "int4" else 0.7)


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        validate_method("int3")


@pytest.mark.skipif(OPS is None or not OPS.has_gemm(torch.float32), reason="gemm.c needs AVX-512")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_tiles_against_float64(method, dtype) -> None:
    """float32 rows: in-register expansion (<= 12 rows) and the scratch tile (40 rows);
    bf16 rows: the scratch tile in bf16; both against x @ dequantized W in float64."""
    if not OPS.has_gemm(dtype):
        pytest.skip("no AVX512-BF16")
    w = _w(200, 96, 2)  # 200 columns: a partial last tile
    p = quantize(w, method)
    gw = place(p, dtype, "cpu", "tiles")
    ref_w = dequantize(p).double()
    if dtype == torch.bfloat16:
        ref_w = ref_w.to(torch.bfloat16).double()  # the kernel's tile holds W rounded to bf16
    for m in (1, 5, 40):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = OPS.gemm(x, gw)
        assert _rel(y, x.double() @ ref_w.T) < (1e-6 if dtype == torch.float32 else 8e-3)


def _cfg() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=False)


def _dequantized(src, method: str):
    """The same checkpoint with every layer matrix replaced by its quantized values."""
    return cuda_t._Dict({k: dequantize(quantize(v, method)) if ".layers." in k and v.dim() == 2 else v
                         for k, v in src.t.items()})


def _logits(model, ids: torch.Tensor, dev: str) -> torch.Tensor:
    cfg = model.config
    caches = [torch.zeros(kv_cache_shape(cfg, 2, 16), dtype=model.dtype, device=dev) for _ in range(cfg.num_layers)]
    with torch.inference_mode():
        h = model(ids.to(dev), torch.arange(len(ids)).to(dev), caches, build_metadata([SeqStep([0, 1], 0, len(ids))], 16, 0))
        return model.compute_logits(h).cpu()


@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_equals_its_dequantized_weights(method) -> None:
    """The loader's quantized model (gemm.c tiles where they build, else the dense fallback)
    computes what torch computes on the dequantized weights (float32)."""
    cfg = _cfg()
    src = cuda_t._weights(cfg)
    ours = build(cfg, src, torch.float32, quantization=method)
    if OPS is not None and OPS.has_gemm(torch.float32):
        assert isinstance(ours.ops, GemmOps) and ours.layers[0].qkv.bits
    ref = build(cfg, _dequantized(src, method), torch.float32, ops=TorchOps(cfg), cpu_kernels=False)
    ids = torch.randint(0, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(5))
    assert _rel(_logits(ours, ids, "cpu"), _logits(ref, ids, "cpu")) < 1e-5
    plain = build(cfg, src, torch.float32, ops=TorchOps(cfg), cpu_kernels=False)
    assert _rel(_logits(ours, ids, "cpu"), _logits(plain, ids, "cpu")) > 1e-5  # it did quantize


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_triton_dequant_gemm_against_float64(int4, rows) -> None:
    method = "int4" if int4 else "int8"
    w = _w(100, 128, 3)
    qw = QuantWeight.build(quantize(w, method), torch.device(DEV))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    y = dequant_gemm(x.to(DEV), qw.codes, qw.scale, qw.zero, qw.n, int4)
    ref = x.double() @ dequantize(quantize(w, method)).double().T
    assert y.shape == (rows, 100) and _rel(y, ref) < 1e-6
    assert _rel(qw.linear(x.to(DEV)), ref) < 1e-6  # the layer's entry point


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows,k", [(1, 512), (2, 96), (3, 128), (4, 256)])
def test_gemv_decode_rows_against_float64(method, rows, k) -> None:
    """Decode-sized batches go through cuda_gemv's weight stream (every method, W8A16 for fp8):
    exact against float64 over the dequantized weight; 100 channels leave a partial block."""
    w = _w(100, k, 5)
    qw = QuantWeight.build(quantize(w, method), torch.device(DEV))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = qw.linear(x.to(DEV))
    assert y.shape == (rows, 100) and _rel(y, x.double() @ qw.dense(torch.float64).double().cpu().T) < 1e-6
    wide = torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(2))[:, ::2]  # strided rows
    assert _rel(qw.linear(wide.to(DEV)), wide.double() @ qw.dense(torch.float64).double().cpu().T) < 1e-6


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_gate_up_silu_against_float64(method, rows) -> None:
    """The MLP's [gate | up] product with SiLU·up: one gated GEMV launch up to 4 rows, the product
    then silu_mul above; both against float64 over the dequantized weight (50 channels: a partial block)."""
    from kvyard.workers.model.cuda_ops import gate_up_silu

    w = _w(100, 256, 8)
    qw = QuantWeight.build(quantize(w, method), torch.device(DEV))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 4
    gu = x.double() @ qw.dense(torch.float64).double().cpu().T
    ref = torch.nn.functional.silu(gu[:, :50]) * gu[:, 50:]
    y = gate_up_silu(x.to(DEV), qw)
    assert y.shape == (rows, 50) and _rel(y, ref) < 1e-6


@pytest.mark.parametrize("method", METHODS)
def test_dequantize_weight_kernel_equals_dense(method) -> None:
    """The one-launch dequantization that prefill-sized products hand to cuBLAS."""
    from kvyard.workers.model.quant.cuda_gemv import dequantize_weight
    from kvyard.workers.model.quant.cuda_quant import KINDS

    qw = QuantWeight.build(quantize(_w(70, 160, 6), method), torch.device(DEV))
    got = dequantize_weight(qw.codes, qw.scale, qw.zero, qw.n, qw.k, KINDS[method], torch.float32)
    assert torch.equal(got.cpu(), qw.dense(torch.float32).cpu())


def test_fused_fp8_row_quantization_matches_torch() -> None:
    """The one-launch row quantizer feeding `_scaled_mm` gives torch's codes and scales."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    x[2] = 0.0  # an all-zero row keeps the floor scale
    q, s = quantize_rows_fp8_fused(x.to(DEV), FP8_MAX)
    rq, rs = quantize_rows_fp8(x)
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


def test_fp8_rows_and_scaled_mm() -> None:
    """Per-row E4M3 activations, and the W8A8 product against float64 of both quantized sides."""
    w, x = _w(64, 96, 4), torch.randn(5, 96, generator=torch.Generator().manual_seed(9))
    xq, a = quantize_rows_fp8(x)
    assert ((xq.float() * a - x).abs() <= x.abs().amax(1, keepdim=True) * 2 ** -4).all()
    qw = QuantWeight.build(quantize(w, "fp8"), torch.device("cpu"))
    ref = (xq.double() * a.double()) @ qw.dense(torch.float64).T
    if qw.fp8_mm:  # torch's CPU build has it; else the layer dequantizes (checked below)
        y = qw.linear(x.to(torch.bfloat16))
        assert _rel(y, ref) < 1e-2
    assert _rel(qw.linear(x), x.double() @ qw.dense(torch.float64).T) < 1e-6  # float32: dequantized


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tokens", [11, 3, 1])
def test_model_on_cuda_ops_with_quantized_weights(method, tokens, monkeypatch) -> None:
    """CudaOps with QuantWeight matrices (TRITON_INTERPRET on CPU) = torch on the dequantized weights.
    Up to 4 rows every product is a GEMV with the seams folded in (norms as pending inputs,
    residual adds in the o and down epilogues, SiLU·up in the gate/up one)."""
    cfg = _cfg()
    src = cuda_t._weights(cfg)
    ours = build(cfg, src, torch.float32, device=DEV, ops=CudaOps(cfg), quantization=method)
    assert isinstance(ours.layers[0].qkv, QuantWeight) and ours.layers[0].qkv.method == method
    ref = build(cfg, _dequantized(src, method), torch.float32, ops=TorchOps(cfg), cpu_kernels=False)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(6))
    if tokens <= 4:   # every norm after the first is folded into a GEMV, none computed apart
        from kvyard.workers.model.cuda_ops import PendingNorm

        monkeypatch.setattr(PendingNorm, "materialize", lambda self: pytest.fail("a norm ran apart"))
    assert _rel(_logits(ours, ids, DEV), _logits(ref, ids, "cpu")) < 1e-5


def test_gemv_autotuner_restores_the_residual_it_adds_into() -> None:
    """On CUDA the GEMV's block shape is autotuned at first use, possibly on a live eager step;
    with RES each timed run adds into the residual in place, so the tuner must restore it."""
    from kvyard.workers.model.quant.cuda_gemv import _gemv_tuned

    assert "y_ptr" in _gemv_tuned.restore_value and {"NORM", "RES", "GATED"} <= set(_gemv_tuned.keys)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("seam", ["plain", "gated", "norm", "residual"])
def test_gemv_one_row_acc2d_against_float64(method, seam) -> None:
    """ACC2D, a launch the tuner may pick for one row of int8 or fp8 codes (products summed
    element-wise over the K tiles, reduced once): exact against float64 like the per-tile
    reduction, through every seam the GEMV folds in (72 outputs: a partial block)."""
    from kvyard.workers.model.quant.cuda_gemv import _gemv_kernel
    from kvyard.workers.model.quant.cuda_quant import KINDS

    n, k = 144 if seam == "gated" else 72, 256
    qw = QuantWeight.build(quantize(_w(n, k, 21), method), torch.device(DEV))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    nw = torch.rand(k, generator=torch.Generator().manual_seed(4)) + 0.5
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw if seam in ("norm", "gated") else x
    p = xn.double() @ qw.dense(torch.float64).double().cpu().T
    if seam == "gated":
        p = torch.nn.functional.silu(p[:, :72]) * p[:, 72:]
    res = torch.randn(1, 72, generator=torch.Generator().manual_seed(5))
    ref = p + res.double() if seam == "residual" else p
    for acc2d in (True, False):
        y = res.clone().to(DEV) if seam == "residual" else torch.empty(1, 72, device=DEV)
        q = qw.codes.view(torch.uint8) if qw.codes.dtype == torch.float8_e4m3fn else qw.codes
        _gemv_kernel[((72 + 15) // 16,)](x.to(DEV), q, qw.scale, qw.scale, y, nw.to(DEV), 72, k, k, 72,
                                             1e-5, M=1, KIND=KINDS[method], GATED=seam == "gated",
                                             NORM=seam in ("norm", "gated"), RES=seam == "residual", BN=16, BK=128,
                                             ACC2D=acc2d, num_warps=4)
        assert _rel(y, ref) < 1e-6, acc2d


def test_gemv_tuner_offers_acc2d_to_one_row_of_byte_codes_only() -> None:
    from kvyard.workers.model.quant.cuda_gemv import _TUNE, _prune

    def acc2d(m: int, kind: int) -> set[bool]:
        return {bool(c.kwargs.get("ACC2D")) for c in _prune(_TUNE, {"K": 4096}, M=m, KIND=kind)}

    assert acc2d(1, 2) == acc2d(1, 0) == {True, False}
    assert acc2d(1, 1) == acc2d(2, 2) == acc2d(4, 0) == {False}


def test_gpu_gemv_bench_launches_every_configuration_it_times() -> None:
    """Each tuner configuration `kvyard.bench.gpu_gemv` times runs the real kernel (on the CPU
    under the interpreter: a small gated product), ACC2D ones at one row of byte codes only."""
    from kvyard.bench import gpu_gemv

    runs = []

    def once(fn):
        fn()
        runs.append(1)
        return 1.0

    p = gpu_gemv.Product("gate_up", 2 * 64, 2048, gated=True, norm=True)
    one = gpu_gemv.measure(torch, p, "fp8", 1, dev=DEV, bench=once)
    four = gpu_gemv.measure(torch, p, "int8", 4, dev=DEV, bench=once)
    assert len(runs) == len(one["configs_s"]) + len(four["configs_s"]) == 12 + 4 + 12
    assert any(k.endswith("/acc2d") for k in one["configs_s"]) and "acc2d_speedup" in one
    assert not any(k.endswith("/acc2d") for k in four["configs_s"])
