"""fp8_e4m3 decode attention over the two physical KV orders (workers/engine/kv_layout.py):
`python3 -m kvyard.bench.gpu_kvlayout --out FILE.json [--shapes 8x8192,64x2048]` on a GPU.

Per batch x context of gpu_kvquant's 8B attention, for NHD and HND caches holding the same
random K/V: bf16 decode, fp8_e4m3 decode (the shipped Triton tiles at their splits, and the
Gluon kernel at 64 and 128 keys a tile), and a read-only pass over every K and V row (`_stream`:
int32 loads xor-ed, no attention math) as the layout's read ceiling. Throughput per byte is
against NHD bf16 in the same run; each HND output must equal its NHD twin bit for bit.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kvyard.bench.gpu_kernels import _time_ms
from kvyard.bench.gpu_kvquant import BS, HD, NH, NKV, SHAPES, build, kv_bytes, quantized
from kvyard.workers.attention.triton_decode import DecodeWorkspace, decode_config, paged_decode
from kvyard.workers.attention.triton_decode_bare import splits_for
from kvyard.workers.engine import kv_layout


@triton.jit
def _stream(k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, stride_bt, stride_cb, stride_ct, stride_ch,
            W: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Read every K and V row of one (sequence, KV head) as int32 words: the layout's read ceiling."""
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    acc = tl.zeros([BLOCK_N, W], tl.int32)
    c = tl.arange(0, W)
    for n0 in range(0, n, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < n
        blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
        row = tl.multiple_of(blk * stride_cb + (pos % BS) * stride_ct + kh * stride_ch, 4)
        off = row[:, None] + c[None, :]
        acc ^= tl.load(k_ptr + off, mask=valid[:, None], other=0)
        acc ^= tl.load(v_ptr + off, mask=valid[:, None], other=0)
    tl.store(o_ptr + b * 64 + kh, tl.sum(tl.sum(acc, 1), 0))


def stream_ms(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> float:
    """ms of one read-only pass over `cache` (any physical order), as a CUDA-graph replay."""
    w = cache.view(torch.int32)
    kc, vc = w[0], w[1]
    B = tables.shape[0]
    o = torch.empty(B * 64, dtype=torch.int32, device="cuda")

    def call():
        _stream[(B, kc.shape[2])](kc, vc, tables, lens, o, tables.stride(0), kc.stride(0), kc.stride(1),
                                  kc.stride(2), W=kc.shape[3], BS=kc.shape[1], BLOCK_N=64, num_warps=4, num_stages=3)
    return _time_ms(torch, call, 20, 7, graph=True)


def hnd(x: torch.Tensor) -> torch.Tensor:
    """The same logical cache with each block's rows grouped by KV head in memory."""
    return kv_layout.allocate(tuple(x.shape), True, lambda shape: torch.empty(shape, dtype=x.dtype,
                                                                              device=x.device)).copy_(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m kvyard.bench.gpu_kvlayout")
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="8x8192,64x2048,256x512", help="batch x context, comma-separated")
    a = p.parse_args(argv)
    shapes = [s for s in SHAPES if f"{s[0]}x{s[1]}" in a.shapes.split(",")]
    res = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, ctx in shapes:
        cache, tables, lens, q = build(torch, B, ctx)
        base = decode_config(B, NKV, tables.shape[1] * BS, sms)
        out = torch.empty_like(q)
        ws0 = DecodeWorkspace.allocate(B, NH, HD, base.num_splits, "cuda") if base.num_splits > 1 else None
        cfg4 = replace(base, num_splits=splits_for(base.num_splits, ctx))
        ws4 = DecodeWorkspace.allocate(B, NH, HD, cfg4.num_splits, "cuda") if cfg4.num_splits > 1 else None
        gluon = {bn: replace(base, quant_variant="gluon", quant_block_n=bn, quant_num_warps=4) for bn in (64, 128)}
        c = quantized(torch, cache, "fp8_e4m3")
        fb, bb = kv_bytes(B, ctx, q.numel(), "fp8_e4m3"), kv_bytes(B, ctx, q.numel(), "bf16")
        ms = {}
        for lay in ("nhd", "hnd"):
            cc, c8 = (cache, c) if lay == "nhd" else (hnd(cache), hnd(c))
            ms[f"{lay}/bf16"] = _time_ms(torch, lambda: paged_decode(q, cc, tables, lens, HD ** -0.5, out=out,
                                                                     config=base, workspace=ws0), 20, 7, graph=True)
            ms[f"{lay}/fp8_triton"] = _time_ms(torch, lambda: paged_decode(
                q, c8, tables, lens, HD ** -0.5, out=out, config=cfg4, workspace=ws4), 20, 7, graph=True)
            for bn, cfg in gluon.items():
                ms[f"{lay}/fp8_gluon{bn}"] = _time_ms(torch, lambda cfg=cfg: paged_decode(
                    q, c8, tables, lens, HD ** -0.5, out=out, config=cfg, workspace=ws0), 20, 7, graph=True)
            ms[f"{lay}/stream_bf16"] = stream_ms(cc, tables, lens)
            ms[f"{lay}/stream_fp8"] = stream_ms(c8, tables, lens)
            outs = [paged_decode(q, x, tables, lens, HD ** -0.5, config=cf, workspace=w).clone()
                    for x, cf, w in ((cc, base, ws0), (c8, cfg4, ws4), (c8, gluon[128], ws0))]
            if lay == "nhd":
                ref_outs = outs
            else:
                same = [torch.equal(x, y) for x, y in zip(ref_outs, outs)]
                print(f"  {B}x{ctx} HND outputs equal NHD's (bf16, triton, gluon): {same}", flush=True)
            del cc, c8
        ref = ms["nhd/bf16"]
        pb = {k: round((fb / v) / (bb / ref), 3) for k, v in ms.items() if "/fp8" in k}
        sp = round((fb / ms["nhd/stream_fp8"]) / (bb / ms["nhd/stream_bf16"]), 3)
        sh = round((fb / ms["hnd/stream_fp8"]) / (bb / ms["hnd/stream_bf16"]), 3)
        gbs = {k: round((fb if "fp8" in k else bb) / v / 1e6) for k, v in ms.items()}
        print(f"{B}x{ctx}: GB/s {gbs}; fp8 per byte vs NHD bf16 "
              + ", ".join(f"{k} {v}" for k, v in pb.items() if "stream" not in k)
              + f"; read-only pass, fp8 vs bf16 per byte: NHD {sp}, HND {sh}", flush=True)
        res[f"{B}x{ctx}"] = {"ms": {k: round(v, 4) for k, v in ms.items()}, "gbps": gbs, "per_byte_vs_nhd_bf16": pb,
                             "stream_per_byte_fp8_vs_bf16": {"nhd": sp, "hnd": sh}}
        json.dump({"device": torch.cuda.get_device_name(), "shapes": res}, open(a.out, "w"), indent=1)
        del c, cache
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
