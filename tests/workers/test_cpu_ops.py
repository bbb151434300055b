"""The C RMSNorm and RoPE (workers/cpu_ops), bf16 and float32, against HF's formulas."""
from __future__ import annotations

import types

import pytest
import torch

from kvyard.workers import cpu_ops
from kvyard.workers.model.rope import apply_rope, rope_table


@pytest.fixture(scope="module")
def ops() -> cpu_ops.CpuOps:
    k = cpu_ops.load()
    assert k is not None, "CI installs a C compiler; the kernels must build"
    return k


def test_rms_norm_matches_hf_rounding(ops: cpu_ops.CpuOps) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(257, 576, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)  # LlamaRMSNorm
    got = ops.rms_norm(x, w, 1e-5)
    ulp = (want.float().abs() * 2 ** -7).clamp_min(1e-30)
    assert ((got.float() - want.float()).abs() <= ulp).all(), "within one bf16 ulp everywhere"
    assert (got == want).float().mean().item() > 0.999, "and bit-equal almost everywhere"
    strided = torch.cat([x, x], 1)[:, :576]  # a view with a row stride
    assert torch.equal(ops.rms_norm(strided, w, 1e-5), got)


def test_float32_norm_and_rope_match_hf_to_an_ulp(ops: cpu_ops.CpuOps) -> None:
    """float32: HF's arithmetic in HF's order; only the sum of squares' order (and FMA
    contraction) may differ, so results agree to a few float32 ulps."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(33, 576, generator=g) * 3, torch.rand(576, generator=g) + 0.5
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = ops.rms_norm(x, w, 1e-5)
    assert (got - want).abs().max().item() <= 4 * 2 ** -23 * want.abs().max().item()
    cfg = types.SimpleNamespace(head_dim=64, rope_theta=100000.0, rope_scaling=None)
    table = rope_table(cfg, 4096, torch.float32)
    qk = torch.randn(40, 12, 64, generator=g)
    pos = torch.randint(0, 4096, (40,), generator=g)
    ref = apply_rope(qk.clone(), table.index_select(0, pos).unsqueeze(1))
    out = ops.rope_(qk, pos, table)
    assert (out - ref).abs().max().item() <= 4 * 2 ** -23 * ref.abs().max().item()


def test_rope_rotates_in_place_like_hf(ops: cpu_ops.CpuOps) -> None:
    cfg = types.SimpleNamespace(head_dim=64, rope_theta=100000.0, rope_scaling=None)
    table = rope_table(cfg, 4096, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(300, 18 * 64, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (300,), generator=g)
    before = qkv.clone()
    ref = apply_rope(before[:, :15 * 64].view(300, 15, 64).float(), table.float().index_select(0, pos).unsqueeze(1))
    out = ops.rope_(qkv[:, :15 * 64].view(300, 15, 64), pos, table)
    assert out.data_ptr() == qkv.data_ptr(), "in place"
    assert torch.equal(qkv[:, 15 * 64:], before[:, 15 * 64:]), "v columns untouched"
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 ** -7 * ref.abs().max().item(), err  # one rounding to bf16


def test_bad_layouts_are_refused(ops: cpu_ops.CpuOps) -> None:
    with pytest.raises(ValueError):
        ops.rms_norm(torch.randn(4, 8).half(), torch.ones(8).half(), 1e-5)  # no float16 kernels
    with pytest.raises(ValueError):
        ops.rms_norm(torch.randn(4, 8), torch.ones(8).to(torch.bfloat16), 1e-5)  # mixed dtypes
    with pytest.raises(ValueError):
        ops.rope_(torch.randn(2, 3, 64).to(torch.bfloat16), torch.zeros(2, dtype=torch.int32),
                  torch.zeros(8, 2, 2, 32, dtype=torch.bfloat16))
