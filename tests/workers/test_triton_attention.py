"""The Triton attention kernels against a dense float64 reference.

Without a GPU they run under TRITON_INTERPRET=1 (numpy on the CPU, float32 and
float16: the interpreter has no bfloat16), with small tiles so that every
loop, mask and split runs more than once. On CUDA the same cases run in
bfloat16 with the kernels' own tile sizes. Tolerances are ‖out − ref‖ / ‖ref‖:
float32 1e-5 (exact dots), float16 3e-3 and bfloat16 1.5e-2 (the inputs are
exact; the softmax weights are rounded to the input type before the PV
product, as flash attention does, and the output is rounded once more).
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
from kvyard.workers.attention.triton_decode import DecodeConfig, paged_decode  # noqa: E402
from kvyard.workers.attention.triton_kv_write import rope_write_kv, write_kv  # noqa: E402
from kvyard.workers.attention.triton_prefill import PrefillConfig, paged_prefill, prefill_config  # noqa: E402
from kvyard.workers.model.rope import apply_rope  # noqa: E402

if not CUDA:
    # numpy >= 2.4 refuses int() of a 1-element array, which triton 3.6's interpreter does for
    # loop bounds read from memory (triton-lang/triton#9171); squeeze first, as the fix upstream does.
    from triton.runtime import interpreter as _interp

    _patch_tensor = _interp._patch_lang_tensor  # an AttributeError here: a triton whose interpreter moved on

    def _patch_lang_tensor(tensor, scope) -> None:
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor

DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


class _Batch:
    """Sequences as (cached, new) token counts, their blocks scattered over a cache that holds
    garbage everywhere else, the cached prefixes written there by plain indexing."""

    def __init__(self, specs: list[tuple[int, int]], bs: int, nkv: int, nh: int, hd: int,
                 dtype: torch.dtype, seed: int, num_blocks: int = 0, width: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.specs, self.bs, self.nh = specs, bs, nh
        need = [-(-(c + n) // bs) for c, n in specs]
        ids = torch.randperm(max(num_blocks, sum(need) + 3), generator=g).tolist()
        self.block_ids = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(specs))]
        self.width = max(width, max(need) + 1)  # at least one padding column beyond the longest
        cache = torch.randn(2, len(ids), bs, nkv, hd, generator=g) * 4
        self.ctx = [torch.randn(2, c + n, nkv, hd, generator=g).to(dtype) for c, n in specs]
        for kv, blocks, (c, _) in zip(self.ctx, self.block_ids, specs):
            for pos in range(c):
                cache[:, blocks[pos // bs], pos % bs] = kv[:, pos].float()
        self.cache = cache.to(dtype).to(DEV)
        self.q = torch.randn(sum(n for _, n in specs), nh, hd, generator=g).to(dtype).to(DEV)

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([kv[0, c:] for kv, (c, _) in zip(self.ctx, self.specs)])
        v = torch.cat([kv[1, c:] for kv, (c, _) in zip(self.ctx, self.specs)])
        return k.to(DEV), v.to(DEV)

    def slots(self) -> torch.Tensor:
        return torch.tensor([b[p // self.bs] * self.bs + p % self.bs for b, (c, n) in zip(self.block_ids, self.specs)
                             for p in range(c, c + n)], dtype=torch.int64, device=DEV)

    def tables(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        bt = torch.zeros(len(self.specs), self.width, dtype=dtype)
        for i, b in enumerate(self.block_ids):
            bt[i, :len(b)] = torch.tensor(b, dtype=dtype)
        return bt.to(DEV)

    def lens(self) -> torch.Tensor:
        return torch.tensor([c + n for c, n in self.specs], dtype=torch.int32, device=DEV)

    def query_start(self) -> torch.Tensor:
        qsl = [0]
        for _, n in self.specs:
            qsl.append(qsl[-1] + n)
        return torch.tensor(qsl, dtype=torch.int32, device=DEV)

    def reference(self, scale: float) -> torch.Tensor:
        """float64 attention of each sequence's new tokens over its whole context, causally."""
        outs, t = [], 0
        for kv, (c, n) in zip(self.ctx, self.specs):
            q = self.q[t:t + n].double().cpu()
            t += n
            k, v = kv.double().repeat_interleave(self.nh // kv.shape[2], dim=2)
            s = torch.einsum("qhd,khd->hqk", q, k) * scale
            allowed = torch.arange(c + n)[None, :] <= (torch.arange(n) + c)[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        return torch.cat(outs)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


DECODE_CASES = [  # block size, GQA ratio, head dim, splits
    (16, 1, 64, 1),
    (16, 4, 128, 3),
    (32, 8, 64, 4),
    (64, 4, 128, 2),
    (4, 8, 128, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,gqa,hd,splits", DECODE_CASES)
def test_decode_matches_reference(bs: int, gqa: int, hd: int, splits: int, dtype: torch.dtype) -> None:
    nkv = 1 if gqa == 8 else 2
    lens = [1, 17, 2 * bs, 75, bs + 1]
    batch = _Batch([(n - 1, 1) for n in lens], bs, nkv, nkv * gqa, hd, dtype, seed=bs + gqa + hd + splits)
    k, v = batch.new_kv()
    write_kv(k, v, batch.cache, batch.slots())
    cfg = DecodeConfig(num_splits=splits, block_n=64 if CUDA else 16)
    out = paged_decode(batch.q, batch.cache, batch.tables(), batch.lens(), hd ** -0.5,
                       out=_poisoned(batch.q), config=cfg)
    assert torch.isfinite(out).all(), "every output element is written"
    assert _rel(out, batch.reference(hd ** -0.5)) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_padding_rows_give_zeros(splits: int) -> None:
    """A captured batch pads with length-0 rows: they come out as zeros, not NaN."""
    dtype = DTYPES[0]
    batch = _Batch([(9, 1), (0, 0), (30, 1), (0, 0)], 16, 2, 4, 64, dtype, seed=splits)
    k, v = batch.new_kv()
    write_kv(k, v, batch.cache, batch.slots())
    q = torch.randn(4, 4, 64, device=DEV).to(dtype)
    out = paged_decode(q, batch.cache, batch.tables(), batch.lens(), 0.125, out=_poisoned(q),
                       config=DecodeConfig(num_splits=splits, block_n=64 if CUDA else 16))
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    batch.q = q[[0, 2]]
    assert _rel(out[[0, 2]], batch.reference(0.125)) < TOL[dtype]


PREFILL_CASES = [  # block size, GQA ratio, head dim
    (16, 1, 64),
    (16, 4, 128),
    (32, 8, 64),
    (64, 4, 128),
]
# fresh prompt, unaligned prefix hit, block-aligned prefix hit (a later chunk), one token after a prefix
PREFILL_SPECS = [(0, 37), (20, 5), (32, 16), (45, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,gqa,hd", PREFILL_CASES)
def test_prefill_matches_reference(bs: int, gqa: int, hd: int, dtype: torch.dtype) -> None:
    nkv = 1 if gqa == 8 else 2
    batch = _Batch(PREFILL_SPECS, bs, nkv, nkv * gqa, hd, dtype, seed=bs * gqa + hd)
    k, v = batch.new_kv()
    write_kv(k, v, batch.cache, batch.slots())
    cfg = None if CUDA else PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    out = paged_prefill(batch.q, batch.cache, batch.tables(torch.int64), batch.query_start(), batch.lens(), hd ** -0.5,
                        max_query_len=37, out=_poisoned(batch.q), config=cfg)
    assert torch.isfinite(out).all(), "every output element is written"
    assert _rel(out, batch.reference(hd ** -0.5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_verify_shaped_default_config(dtype: torch.dtype) -> None:
    """Verify steps (1 + k queries per row over a long context) take the default config, whose
    query tile fits the few rows; results match the reference on every device."""
    assert prefill_config(64, 5).block_m == 16 and prefill_config(64, 20).block_m == 32
    assert prefill_config(128, 512) == prefill_config(128)
    specs = [(70, 5), (33, 5), (90, 5)]
    batch = _Batch(specs, 16, 2, 8, 64, dtype, seed=11)
    k, v = batch.new_kv()
    write_kv(k, v, batch.cache, batch.slots())
    out = paged_prefill(batch.q, batch.cache, batch.tables(torch.int64), batch.query_start(), batch.lens(),
                        0.125, max_query_len=5, out=_poisoned(batch.q))
    assert torch.isfinite(out).all()
    assert _rel(out, batch.reference(0.125)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_batch(dtype: torch.dtype) -> None:
    """Decodes first, then prefill chunks, through the AttentionBackend boundary."""
    specs = [(0, 1), (17, 1), (7, 1), (9, 13), (0, 10), (8, 1)]
    batch = _Batch(specs, 16, 2, 8, 64, dtype, seed=7)
    meta = build_metadata([SeqStep(b, c, n) for b, (c, n) in zip(batch.block_ids, specs)], 16, num_decodes=3)
    k, v = batch.new_kv()
    out = TritonBackend().forward(batch.q, k, v, batch.cache, meta, 0.125)
    assert _rel(out, batch.reference(0.125)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_strided_views(dtype: torch.dtype) -> None:
    """k and v as views of one fused qkv output; only the named slots change, bit for bit."""
    g = torch.Generator().manual_seed(3)
    nkv, hd, T = 3, 64, 9
    cache = torch.randn(2, 6, 16, nkv, hd, generator=g).to(dtype).to(DEV)
    qkv = torch.randn(T, 8 + 2 * nkv, hd, generator=g).to(dtype).to(DEV)
    k, v = qkv[:, 8:8 + nkv], qkv[:, 8 + nkv:]
    slots = torch.randperm(6 * 16, generator=g)[:T].to(DEV)
    slots[4] = -1
    want = cache.clone().view(2, -1, nkv, hd)
    keep = slots >= 0
    want[0, slots[keep]] = k[keep]
    want[1, slots[keep]] = v[keep]
    write_kv(k, v, cache, slots)
    assert torch.equal(cache.view(2, -1, nkv, hd), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_matches_model_rope(dtype: torch.dtype) -> None:
    """RoPE as the model applies it (rope.py's table layout), on q in place and on k as stored."""
    g = torch.Generator().manual_seed(4)
    nh, nkv, hd, T, P = 8, 2, 128, 7, 64
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).double() / hd)
    ang = torch.outer(torch.arange(P).double(), inv)
    cos, sin = ang.cos(), ang.sin()
    table = torch.stack((torch.stack((cos, cos), 1), torch.stack((-sin, sin), 1)), 1).to(dtype)  # rope_table's layout
    qkv = torch.randn(T, nh + 2 * nkv, hd, generator=g).to(dtype)
    pos = torch.randint(0, P, (T,), generator=g)
    want = apply_rope(qkv[:, :nh + nkv].double(), table.double()[pos][:, None])
    qkv, table_d = qkv.to(DEV), table.to(DEV)
    q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
    cache = torch.full((2, 4, 16, nkv, hd), float("nan"), dtype=dtype, device=DEV)
    slots = torch.arange(T, device=DEV) * 3
    rope_write_kv(q, k, v, cache, slots, pos.to(DEV), table_d[:, 0, 0], table_d[:, 1, 1])
    flat = cache.view(2, -1, nkv, hd)
    assert _rel(q, want[:, :nh]) < TOL[dtype] / 2
    assert _rel(flat[0, slots], want[:, nh:]) < TOL[dtype] / 2
    assert torch.equal(flat[1, slots], v)
    assert torch.isfinite(flat[:, slots]).all()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed after the metadata tensors change in place: the launch depends on
    shapes only."""
    from kvyard.workers.attention.triton_decode import DecodeWorkspace

    dtype = torch.bfloat16
    first = _Batch([(40, 1), (3, 1), (100, 1)], 16, 2, 8, 128, dtype, seed=11, num_blocks=24, width=8)
    second = _Batch([(70, 1), (15, 1), (8, 1)], 16, 2, 8, 128, dtype, seed=12, num_blocks=24, width=8)
    cfg = DecodeConfig(num_splits=4)
    ws = DecodeWorkspace.allocate(3, 8, 128, 4, DEV)
    q, cache, tables, lens, slots = first.q, first.cache, first.tables(), first.lens(), first.slots()
    k, v = first.new_kv()
    out = torch.empty_like(q)

    def step() -> None:
        write_kv(k, v, cache, slots)
        paged_decode(q, cache, tables, lens, 128 ** -0.5, out=out, config=cfg, workspace=ws)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for dst, src in [(cache, second.cache), (tables, second.tables()), (lens, second.lens()),
                     (slots, second.slots()), (q, second.q), *zip((k, v), second.new_kv())]:
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, second.reference(128 ** -0.5)) < TOL[dtype]
