"""The quantized decode GEMV per product of an 8B layer, every launch shape the tuner tries:
`python3 -m kvyard.bench.gpu_quant`'s batch-1 step spends most of its time here, and this says
where (which product, which launch shape, what share of the copy bandwidth).

`python3 -m kvyard.bench.gpu_gemv --out FILE.json [--methods fp8,int8] [--rows 1,4]` on the GPU
host. Per method, product (qkv with the folded RMSNorm, o adding into the residual, gate/up
with SiLU·up and the norm, down adding into the residual) and row count: the time of each
configuration of cuda_gemv's tuner list that the tuner would try (triton.testing.do_bench,
L2 flushed before each run), the best one with and without ACC2D (same run), the tuner's own
pick, and the codes' bytes over the best time against the device's copy bandwidth.
Codes are random (speed only).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Product:
    name: str
    n: int          # output channels (gated: the gate and up rows together)
    k: int
    gated: bool = False
    norm: bool = False
    res: bool = False

    def n_out(self) -> int:
        return self.n // 2 if self.gated else self.n


def products(cfg) -> list[Product]:
    """The four GEMVs of a decode layer with the quantized path's seams folded in."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return [Product("qkv", q + 2 * kv, h, norm=True), Product("o", h, q, res=True),
            Product("gate_up", 2 * i, h, gated=True, norm=True), Product("down", h, i, res=True)]


def code_bytes(p: Product) -> int:
    """The product's codes: a byte a weight (int8 and fp8, the methods this bench times)."""
    return p.n * p.k


def measure(torch, p: Product, method: str, rows: int, dev: str = "cuda", bench=None) -> dict[str, Any]:
    """`bench(fn)` -> ms (triton.testing.do_bench on CUDA; the tests run it under the interpreter)."""
    import triton
    from triton.testing import do_bench

    from kvyard.workers.model.quant import cuda_gemv
    from kvyard.workers.model.quant.cuda_quant import KINDS

    bench, kind = bench or do_bench, KINDS[method]
    codes = (torch.randint(-127, 128, (p.n, p.k), dtype=torch.int8, device=dev) if method == "int8"
             else (torch.randn(p.n, p.k, device=dev) * 0.1).to(torch.float8_e4m3fn).view(torch.uint8))
    scale = torch.rand(p.n, device=dev) * 0.01
    x = torch.randn(rows, p.k, device=dev, dtype=torch.bfloat16)
    nw = torch.rand(p.k, device=dev, dtype=torch.bfloat16) + 0.5
    y = torch.zeros(rows, p.n_out(), device=dev, dtype=torch.bfloat16)
    flags = dict(M=rows, KIND=kind, GATED=p.gated, NORM=p.norm, RES=p.res)
    args = (x, codes, scale, scale, y, nw, p.n_out(), p.k, x.stride(0), y.stride(0), 1e-5)
    named = dict(zip(cuda_gemv._gemv_kernel.arg_names, args))
    times = {}
    for c in cuda_gemv._prune(cuda_gemv._TUNE, named, **flags):
        grid = (triton.cdiv(p.n_out(), c.kwargs["BN"]),)
        key = "{BN}x{BK}".format(**c.kwargs) + f"/w{c.num_warps}s{c.num_stages}" + ("/acc2d" if c.kwargs.get("ACC2D") else "")
        times[key] = bench(lambda c=c, grid=grid: cuda_gemv._gemv_kernel[grid](
            *args, **flags, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)) * 1e-3
    pick = None
    if dev == "cuda":
        cuda_gemv.gemv(x, codes.view(torch.float8_e4m3fn) if method == "fp8" else codes, scale, None, p.n, kind,
                       gated=p.gated, norm=(nw, 1e-5) if p.norm else None, out=y if p.res else None)
        pick = cuda_gemv._gemv_tuned.best_config.all_kwargs()
    best = min(times, key=times.get)
    plain = min((k for k in times if not k.endswith("/acc2d")), key=times.get)
    acc = [k for k in times if k.endswith("/acc2d")]
    out = {"bytes": code_bytes(p), "best": best, "best_s": times[best], "best_plain": plain,
           "best_plain_s": times[plain], "tuner_pick": str(pick), "configs_s": times}
    if acc:
        a = min(acc, key=times.get)
        out.update(best_acc2d=a, best_acc2d_s=times[a], acc2d_speedup=times[plain] / times[a])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m kvyard.bench.gpu_gemv")
    p.add_argument("--out", required=True)
    p.add_argument("--methods", default="fp8,int8", help="fp8 and/or int8 (int4's codes are laid out otherwise)")
    p.add_argument("--rows", default="1,4")
    a = p.parse_args(argv)
    methods = a.methods.split(",")
    if not set(methods) <= {"fp8", "int8"}:
        p.error("--methods: fp8 and/or int8")
    import torch

    if not torch.cuda.is_available():
        print("gpu_gemv needs CUDA", file=sys.stderr)
        return 2
    from kvyard.bench import gpu_step as gs
    from kvyard.bench.gpu_quant import copy_bandwidth

    bw = copy_bandwidth(torch)
    res: dict[str, Any] = {"card": torch.cuda.get_device_name(), "copy_gb_s": bw / 1e9, "gemv": {}}
    for method in methods:
        for rows in map(int, a.rows.split(",")):
            for prod in products(gs.config_8b()):
                r = measure(torch, prod, method, rows)
                r["of_copy_rate"] = r["bytes"] / r["best_s"] / bw
                res["gemv"][f"{method}/{prod.name}/{rows}"] = r
                print(f"{method} {prod.name} rows {rows}: {r['bytes'] / r['best_s'] / 1e9:,.0f} GB/s "
                      f"({r['of_copy_rate']:.0%} of copy) best {r['best']}; plain best {r['best_plain']} "
                      f"{r['best_plain_s'] * 1e6:.1f} us, acc2d x{r.get('acc2d_speedup', float('nan')):.3f}; "
                      f"tuner {r['tuner_pick']}", flush=True)
                torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
