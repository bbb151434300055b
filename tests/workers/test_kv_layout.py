"""The KV cache's physical order (workers/engine/kv_layout.py): an HND allocation seen as NHD
gives every kernel and block move the same results as a plain NHD cache, bit for bit (on CPU
under TRITON_INTERPRET; the same launches on CUDA in the GPU runs)."""
from __future__ import annotations

import numpy as np
import torch

from .test_triton_attention import DEV  # sets TRITON_INTERPRET first

from kvyard.workers.attention.triton_decode import DecodeConfig, paged_decode  # noqa: E402
from kvyard.workers.attention.triton_kv_write import write_kv  # noqa: E402
from kvyard.workers.attention.triton_prefill import paged_prefill  # noqa: E402
from kvyard.workers.engine import kv_layout  # noqa: E402
from kvyard.workers.engine.kv_blocks import gather, layout_of, scatter  # noqa: E402

NB, BS, NKV, HD, NH = 8, 16, 2, 64, 4


def _cache(hnd: bool) -> torch.Tensor:
    return kv_layout.allocate((2, NB, BS, NKV, HD), hnd,
                              lambda shape: torch.zeros(shape, dtype=torch.uint8, device=DEV))


def test_hnd_is_nhd_shaped_with_heads_outside_tokens() -> None:
    c = _cache(True)
    assert c.shape == (2, NB, BS, NKV, HD)
    assert c.stride() == (NB * NKV * BS * HD, NKV * BS * HD, HD, BS * HD, 1)
    assert kv_layout.physical_shape((2, NB, BS, NKV, HD), False) == (2, NB, BS, NKV, HD)
    assert not kv_layout.uses_hnd("fp8_e4m3", torch.device("cpu")), "CPU caches stay NHD"


def test_kernels_and_block_moves_agree_across_layouts() -> None:
    """fp8_e4m3 codes written, then decode (each Triton variant, split and unsplit), prefill,
    and block gather/scatter through the NHD wire format, on both layouts."""
    g = torch.Generator().manual_seed(0)
    dt = torch.float16 if DEV == "cpu" else torch.bfloat16
    n = 40
    k, v = (torch.randn(n, NKV, HD, generator=g).to(dt).to(DEV) for _ in range(2))
    q = torch.randn(n, NH, HD, generator=g).to(dt).to(DEV)
    slots = torch.tensor([(3, 5, 1)[p // BS] * BS + p % BS for p in range(n)], device=DEV)
    tables = torch.tensor([[3, 5, 1]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([n], dtype=torch.int32, device=DEV)
    got = {}
    for hnd in (False, True):
        c = _cache(hnd)
        write_kv(k, v, c, slots)   # uint8: the fp8_e4m3 format
        outs = [c.contiguous()]
        for variant in ("bytes", "words", "mixed"):
            for splits in (1, 2):
                outs.append(paged_decode(q[-1:].clone(), c, tables, lens, 0.125,
                                         config=DecodeConfig(num_splits=splits, quant_variant=variant)))
        op = torch.empty_like(q)
        paged_prefill(q, c, tables, torch.tensor([0, n], dtype=torch.int32, device=DEV), lens, 0.125,
                      max_query_len=n, out=op)
        got[hnd] = outs + [op]
    assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))

    nhd, hnd = [_cache(False) for _ in range(2)], [_cache(True) for _ in range(2)]
    for a, b in zip(nhd, hnd):
        r = torch.randint(0, 255, a.shape, dtype=torch.uint8, generator=g).to(DEV)
        a.copy_(r)
        b.copy_(r)
    lay = layout_of(nhd)
    assert lay == layout_of(hnd)
    if DEV == "cpu":
        wire = [np.empty((2, lay.nbytes), np.uint8) for _ in range(2)]
        gather(nhd, [4, 2], wire[0])
        gather(hnd, [4, 2], wire[1])
        assert (wire[0] == wire[1]).all(), "the wire format is NHD from either layout"
        for caches in (nhd, hnd):
            scatter(caches, [0, 7], [wire[0][0].tobytes(), wire[0][1].tobytes()])
        assert all(torch.equal(a, b.contiguous()) for a, b in zip(nhd, hnd))
