"""The decoder's CUDA ops (workers/model/cuda_ops.py) against torch, and a whole model on
them (CudaOps + the Triton attention backend) against the same weights on torch's CPU ops.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (float32, float16);
on CUDA in float32 and bfloat16. Tolerances are ‖out − ref‖ / ‖ref‖ against float64.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before they import
triton = pytest.importorskip("triton")

from kvyard.workers.attention.reference import SeqStep, build_metadata  # noqa: E402
from kvyard.workers.attention.triton_backend import TritonBackend  # noqa: E402
from kvyard.workers.model.config import ModelConfig  # noqa: E402
from kvyard.workers.model.cuda_ops import CudaOps, add_rms_norm, rms_norm, silu_mul  # noqa: E402
from kvyard.workers.model.linear_ops import TorchOps  # noqa: E402
from kvyard.workers.model.loader import build, kv_cache_shape  # noqa: E402

if not CUDA:  # the same interpreter fix as test_triton_attention.py (triton-lang/triton#9171)
    from triton.runtime import interpreter as _interp

    if not getattr(_interp, "_kvyard_index_patch", False):
        _patch_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope) -> None:
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._kvyard_index_patch = True

DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
EPS = 1e-5


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm()).item()


def _ref_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 576), (3, 1000)])
def test_norms_against_float64(dtype, rows, n) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype).to(DEV)
    res = torch.randn(rows, n, generator=g).to(dtype).to(DEV)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).to(DEV)
    assert _rel(rms_norm(x, w, EPS), _ref_norm(x, w)) < TOL[dtype]
    summed = (x.double() + res.double()).to(dtype)   # the residual as the add rounds it
    before = res.clone()
    out = add_rms_norm(x, res, w, EPS)
    assert torch.equal(res, summed.to(DEV)) or _rel(res, summed.double()) < TOL[dtype]
    assert not torch.equal(res, before)
    assert _rel(out, _ref_norm(summed, w)) < TOL[dtype]
    wide = torch.randn(rows, 2 * n, generator=g).to(dtype).to(DEV)[:, :n]  # a row stride > n
    assert _rel(rms_norm(wide, w, EPS), _ref_norm(wide, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 96), (4, 1536), (2, 1100)])
def test_silu_mul_against_float64(dtype, rows, inter) -> None:
    g = torch.Generator().manual_seed(inter)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 2).to(dtype).to(DEV)
    ref = torch.nn.functional.silu(gu[:, :inter].double()) * gu[:, inter:].double()
    assert _rel(silu_mul(gu), ref) < TOL[dtype]
    assert silu_mul(gu[:0]).shape == (0, inter)


def _tiny_cfg() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=EPS,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=False)


class _Dict:
    """A WeightSource over a dict of HF-named tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.t = tensors

    def has(self, name: str) -> bool:
        return name in self.t

    def get(self, name: str) -> torch.Tensor:
        return self.t[name]

    def get_int4(self, name: str) -> None:
        return None

    def get_quant(self, name: str) -> None:
        return None


def _weights(cfg: ModelConfig) -> _Dict:
    g = torch.Generator().manual_seed(7)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    t = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g),
         "lm_head.weight": torch.randn(cfg.vocab_size, h, generator=g) * h ** -0.5,
         "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        for name, shape in shapes.items():
            t[p + name] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            t[p + name] = 1 + 0.1 * torch.randn(h, generator=g)
    return _Dict(t)


@pytest.mark.parametrize("rope_in_attention", [True, False])
def test_model_on_cuda_ops_matches_torch_ops(rope_in_attention) -> None:
    """A prefill of 11 + a chunk of 6 (a prefix hit) beside a 1-token decode, then two decodes:
    CudaOps + TritonBackend (RoPE in its KV write, or in torch) against TorchOps + the CPU
    backend, float32."""
    cfg, src = _tiny_cfg(), _weights(_tiny_cfg())
    ours = build(cfg, src, torch.float32, device=DEV, ops=CudaOps(cfg, rope_in_attention))
    assert isinstance(ours.backend, TritonBackend) and (ours.backend.rope is not None) == rope_in_attention
    ref = build(cfg, src, torch.float32, ops=TorchOps(cfg), cpu_kernels=False)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    steps = [([SeqStep([3, 1], 0, 11)], 0), ([SeqStep([3, 1], 11, 1), SeqStep([0, 2], 0, 6)], 1),
             ([SeqStep([3, 1], 12, 1), SeqStep([0, 2], 6, 1)], 2)]
    outs = []
    for model, dev in ((ours, DEV), (ref, "cpu")):
        caches = [torch.zeros(kv_cache_shape(cfg, 4, 8), device=dev) for _ in range(cfg.num_layers)]
        logits = []
        with torch.inference_mode():
            for seqs, nd in steps:
                n = sum(s.num_new for s in seqs)
                pos = torch.cat([torch.arange(s.num_cached, s.num_cached + s.num_new) for s in seqs])
                meta = build_metadata(seqs, 8, nd)
                h = model(ids[:n].to(dev), pos.to(dev), caches, meta)
                logits.append(model.compute_logits(h).cpu())
        outs.append(torch.cat(logits))
    assert _rel(outs[0], outs[1].double()) < 1e-5
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


def test_lora_seams_match_torch_ops() -> None:
    """CudaOps' silu_mul and add_norm (the LoRA layer's elementwise seams) against TorchOps':
    add_norm adds in place into the residual, as the fused path does."""
    cfg = _tiny_cfg()
    h, inter = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(3)
    c, t = CudaOps(cfg), TorchOps(cfg)
    gu = torch.randn(5, 2 * inter, generator=g).to(DEV)
    assert torch.allclose(c.silu_mul(gu), t.silu_mul(gu), rtol=1e-5, atol=1e-6)
    x, y, w = (torch.randn(5, h, generator=g).to(DEV), torch.randn(5, h, generator=g).to(DEV),
               (torch.rand(h, generator=g) + 0.5).to(DEV))
    xc = x.clone()
    got, want = c.add_norm(y, xc, w), t.add_norm(y, x, w)
    assert got[0] is xc and torch.allclose(xc, x + y), "the residual is updated in place"
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    last = c.add_norm(y, x.clone(), None)
    assert last[1] is None and torch.allclose(last[0], x + y)


def test_lora_layer_reads_a_pending_norm_materialized() -> None:
    """A quantized o projection leaves the MLP's input as a pending norm (cuda_ops.PendingNorm);
    the LoRA MLP seam hands its adapters the normalized rows, the same as a dense h gives."""
    from types import SimpleNamespace

    from kvyard.workers.lora import layer as lora_layer
    from kvyard.workers.model.cuda_ops import PendingNorm

    cfg = _tiny_cfg()
    h, inter = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(4)
    ops = CudaOps(cfg)
    lw = SimpleNamespace(gate_up=(torch.randn(2 * inter, h, generator=g) * 0.1).to(DEV), gate=None, up=None,
                         down=(torch.randn(h, inter, generator=g) * 0.1).to(DEV))
    x, w = torch.randn(3, h, generator=g).to(DEV), (torch.rand(h, generator=g) + 0.5).to(DEV)

    class Seen:
        projs = frozenset({"gate_up", "down"})

        def __init__(self) -> None:
            self.inputs: list[torch.Tensor] = []

        def apply(self, i, proj, xin, y) -> None:
            self.inputs.append(xin)

    runs = []
    for hin in (PendingNorm(x, w, EPS), rms_norm(x, w, EPS)):
        seen = Seen()
        res, _ = lora_layer.mlp_add_norm(ops, seen, 0, hin, lw, x.clone(), None)
        runs.append((res, seen.inputs))
    (a, seen_a), (b, seen_b) = runs
    assert isinstance(seen_a[0], torch.Tensor) and torch.equal(seen_a[0], seen_b[0])
    assert torch.equal(a, b)
