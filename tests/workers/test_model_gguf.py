"""The demo GGUF through our loader and model: HF agreement and paged-path consistency."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvyard.common.models import resolve_model
from kvyard.workers.attention.reference import SeqStep, build_metadata
from kvyard.workers.model import kv_cache_shape, load_model

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 253, 1345, 28],
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
     19712, 8182, 2, 198, 1, 4093, 198, 6121, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [42, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 3000, 123],
]


@pytest.fixture(scope="module")
def ours_f32():
    return load_model(resolve_model("demo"), torch.float32)


def _one_shot(model, cfg, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits at every position from a single prefill of `ids`."""
    n = len(ids)
    blocks = list(range(-(-n // block_size)))
    caches = [torch.zeros(kv_cache_shape(cfg, len(blocks), block_size), dtype=model.dtype)
              for _ in range(cfg.num_layers)]
    meta = build_metadata([SeqStep(blocks, 0, n)], block_size, 0)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


def test_matches_transformers_gguf(ours_f32, demo_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, cfg = ours_f32
    hf = AutoModelForCausalLM.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name,
                                              dtype=torch.float32).eval()
    worst = 0.0
    for ids in PROMPTS:
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        got = _one_shot(model, cfg, ids)
        worst = max(worst, (got - ref).abs().max().item())
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    print(f"max |logit diff| vs transformers: {worst:.2e}")
    assert worst < 1e-3


def _same_choices(got: torch.Tensor, want: torch.Tensor, tie: float) -> None:
    """Greedy picks agree, except where `want` has a near-tie (bf16 rounding differs
    with the matmul shapes, so batch composition may flip a tie)."""
    g, w = got.argmax(-1), want.argmax(-1)
    gap = want.gather(-1, w[:, None]) - want.gather(-1, g[:, None])
    assert (gap[g != w] < tie).all(), f"differ at {(g != w).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("dtype,tol,tie", [(torch.float32, 2e-3, 0.0), (torch.bfloat16, 2.0, 0.5)])
def test_chunked_prefill_and_decode_equal_one_shot(dtype: torch.dtype, tol: float, tie: float,
                                                   ours_f32) -> None:
    """Two sequences share a step as the engine batches them: chunked prefill of
    one while the other decodes, scattered blocks, then joint decodes."""
    model, cfg = ours_f32 if dtype == torch.float32 else load_model(resolve_model("demo"), dtype)
    a, b = PROMPTS[1], PROMPTS[0] + PROMPTS[2]
    want_a, want_b = _one_shot(model, cfg, a), _one_shot(model, cfg, b)
    bs = 4
    blocks_a, blocks_b = [3, 17, 8, 1, 12, 20, 5, 14, 2, 19], [11, 0, 16, 6, 9, 15, 4, 18, 7, 10, 13]
    caches = [torch.zeros(kv_cache_shape(cfg, 21, bs), dtype=dtype) for _ in range(cfg.num_layers)]
    got_a: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []

    def step(parts: list[tuple[list[int], list[int], int, list[torch.Tensor], bool]], nd: int) -> None:
        seqs, ids, pos, rows = [], [], [], []
        for seq_ids, blocks, start, sink, _ in parts:
            n = len(seq_ids)
            seqs.append(SeqStep(blocks, start, n))
            ids += seq_ids
            pos += range(start, start + n)
            rows.append(len(ids) - n)
        meta = build_metadata(seqs, bs, nd)
        with torch.inference_mode():
            h = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
            for (seq_ids, _, _, sink, _), r in zip(parts, rows):
                sink.append(model.compute_logits(h[r:r + len(seq_ids)]))

    step([(b[:13], blocks_b, 0, got_b, False)], 0)                                   # b: chunk 1
    step([(a[:10], blocks_a, 0, got_a, False), (b[13:], blocks_b, 13, got_b, False)], 0)
    step([(b[-1:], blocks_b, len(b), got_b, True), (a[10:27], blocks_a, 10, got_a, False)], 1)
    step([(a[27:], blocks_a, 27, got_a, False)], 0)
    # b's first decode consumed its own last token again at position len(b): compare that row
    # with a one-shot over b + [b[-1]]; then joint decodes of both.
    ext_a, ext_b = a + [a[-1], 5], b + [b[-1], 9, 77]
    step([(ext_a[len(a):len(a) + 1], blocks_a, len(a), got_a, True),
          (ext_b[len(b) + 1:len(b) + 2], blocks_b, len(b) + 1, got_b, True)], 2)
    step([(ext_b[len(b) + 2:], blocks_b, len(b) + 2, got_b, True),
          (ext_a[len(a) + 1:], blocks_a, len(a) + 1, got_a, True)], 2)
    full_a = _one_shot(model, cfg, ext_a)
    full_b = _one_shot(model, cfg, ext_b)
    _same_choices(full_a[:len(a)], want_a, tie)
    for got, full in ((torch.cat(got_a), full_a), (torch.cat(got_b), full_b)):
        assert got.shape == full.shape
        _same_choices(got, full, tie)
        diff = (got - full).abs().max().item()
        print(f"{dtype}: max |logit diff| paged vs one-shot {diff:.2e}")
        assert diff < tol


def test_int4_path_matches_dense_bfloat16() -> None:
    """Small steps run on packed Q4 weights; they hold the file's values exactly, so
    logits agree with the dense bf16 path up to bf16 rounding."""
    model, cfg = load_model(resolve_model("demo"), torch.bfloat16, cpu_kernels=False)  # the GEMM replaces int4
    assert model.int4_max_tokens == 8 and all(lw.int4 is not None for lw in model.layers)
    ids = PROMPTS[0][:model.int4_max_tokens]
    int4 = _one_shot(model, cfg, ids)
    model.int4_max_tokens = 0
    dense = _one_shot(model, cfg, ids)
    diff = (int4 - dense).abs().max().item()
    print(f"int4 vs dense bf16: max |logit diff| {diff:.2e}")
    assert 0 < diff < 2.0  # bf16 vs float32 logits differ by up to ~1.5 on this model
    _same_choices(int4, dense, 0.5)

