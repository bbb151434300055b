"""What the quantized cache's row layout costs: decode attention over bare E4M3 rows.

kvyard's fp8 rows are head_dim codes then a float32 scale (kv_quant.py), so rows are only
4-byte aligned. This bench times the bf16 decode kernel's structure over the same values
stored as bare E4M3 rows ([.., head_dim], 16-byte aligned, no scale: vLLM's per-tensor fp8
with scale 1), codes widened to fp16 by the packed convert before the dots, against bf16
over a small tile grid each: the speed an aligned, scale-free layout would allow.
`python3 -m kvyard.bench.gpu_kvquant_bare --out F.json` on the GPU host (tools/device_gpu.sh module).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import triton
import triton.language as tl

from kvyard.bench.gpu_kernels import _geomean
from kvyard.bench.gpu_kvquant import BS, HD, NH, NKV, SHAPES, build
from kvyard.workers.attention.triton_decode_quant import program_range

_E4M3X4 = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")
TILES = ((64, 4, 3), (64, 4, 2), (128, 4, 2), (128, 8, 2), (64, 8, 3), (128, 4, 3), (32, 4, 3))


@triton.jit
def _f16(x):
    """uint8 E4M3 codes -> float16, 4 consecutive codes a PTX block (opaque, so the compiler
    widens in registers before the dot's layout change rather than after it)."""
    return tl.inline_asm_elementwise(_E4M3X4, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _bare_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, part_ptr, lse_ptr,
                 stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_cb, stride_ct, stride_ch,
                 stride_pb, stride_ph, stride_lb, stride_lh, scale_log2,
                 G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                 BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    b, kh, s, start, end, g, heads, gmask = program_range(lens_ptr, G, GP, BLOCK_N, NUM_SPLITS)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask, other=0.0)
    q = q.to(tl.float16)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        blk = tl.load(bt_row + pos // BS, mask=valid, other=0).to(tl.int64)
        off = tl.multiple_of(blk * stride_cb + (pos % BS) * stride_ct + kh * stride_ch, 16)[:, None] + d[None, :]
        k = _f16(tl.load(k_ptr + off, mask=valid[:, None], other=0))
        qk = tl.dot(q, tl.trans(k)) * scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _f16(tl.load(v_ptr + off, mask=valid[:, None], other=0))
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask)
    else:
        tl.store(part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * HD + d[None, :], out, mask=gmask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=g < G)


def measure(torch, B: int, ctx: int, rounds: int) -> dict[str, Any]:
    from kvyard.bench.gpu_kernels import _time_ms
    from kvyard.workers.attention.triton_decode import (LOG2E, DecodeConfig, DecodeWorkspace, _merge_kernel,
                                                        decode_config, paged_decode)

    cache, tables, lens, q = build(torch, B, ctx)
    cfg = decode_config(B, NKV, tables.shape[1] * BS, torch.cuda.get_device_properties(0).multi_processor_count)
    S = cfg.num_splits
    out = torch.empty_like(q)
    ws = DecodeWorkspace.allocate(B, NH, HD, S, "cuda") if S > 1 else None
    part, lse = (ws.partial, ws.lse) if ws else (out, out)
    codes = cache.to(torch.float8_e4m3fn).view(torch.uint8)
    kc, vc = codes[0], codes[1]
    res: dict[str, Any] = {"batch": B, "context": ctx, "splits": S}
    ref = None
    for name in ("bf16", "fp8_bare"):
        best = None
        for bn, w, st in TILES:
            if name == "bf16":
                c2 = DecodeConfig(S, bn, w, st)

                def call(c2=c2):
                    paged_decode(q, cache, tables, lens, HD ** -0.5, out=out, config=c2, workspace=ws)
            else:
                def call(bn=bn, w=w, st=st):
                    _bare_kernel[(B, NKV, S)](
                        q, kc, vc, tables, lens, out, part, lse, q.stride(0), q.stride(1), out.stride(0),
                        out.stride(1), tables.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), part.stride(0),
                        part.stride(1), lse.stride(0), lse.stride(1), HD ** -0.5 * LOG2E,
                        G=NH // NKV, GP=16, HD=HD, BS=BS, BLOCK_N=bn, NUM_SPLITS=S, num_warps=w, num_stages=st)
                    if S > 1:
                        _merge_kernel[(B, NH)](part, lse, out, part.stride(0), part.stride(1), lse.stride(0),
                                               lse.stride(1), out.stride(0), out.stride(1), HD=HD, NUM_SPLITS=S,
                                               SP=triton.next_power_of_2(S), num_warps=4)
            try:
                ms = _time_ms(torch, call, 20, rounds, graph=True)
            except Exception as e:   # a tile that does not fit (shared memory) is skipped
                print(name, bn, w, st, "failed:", str(e)[:100], flush=True)
                continue
            if best is None or ms < best[0]:
                best = (ms, [bn, w, st])
        call_best = out.float().clone()
        if ref is None:
            ref = call_best
        nbytes = B * ctx * 2 * NKV * HD * (2 if name == "bf16" else 1)
        res[name] = {"ms": round(best[0], 4), "tile": best[1], "bytes": nbytes,
                     "gbps": round(nbytes / (best[0] * 1e-3) / 1e9, 1),
                     "rel_err_vs_bf16": round(float((call_best - ref).norm() / ref.norm()), 4)}
    f, b = res["fp8_bare"], res["bf16"]
    f["per_byte_vs_bf16"] = round((f["bytes"] / f["ms"]) / (b["bytes"] / b["ms"]), 3)
    f["speedup_vs_bf16"] = round(b["ms"] / f["ms"], 3)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import torch

    rows = []
    for B, ctx in SHAPES:
        rows.append(measure(torch, B, ctx, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    doc = {"device": torch.cuda.get_device_name(0), "rows": rows,
           "per_byte_vs_bf16": round(_geomean([r["fp8_bare"]["per_byte_vs_bf16"] for r in rows]), 3),
           "speedup_vs_bf16": round(_geomean([r["fp8_bare"]["speedup_vs_bf16"] for r in rows]), 3)}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
