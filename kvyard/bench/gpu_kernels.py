"""`kvyard bench gpu`'s kernel level: kvyard's paged decode and prefill attention against
torch's SDPA on the same bytes, the device copy bandwidth every roofline divides by, and the
CUDA-event timer the whole bench uses (gpu.py's docstring says what each measures)."""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable

DECODE_SHAPES = [(1, 65536), (8, 16384), (64, 4096), (256, 1024)]   # (batch, context)
PREFILL_SHAPES = [(1, 8192), (4, 2048), (16, 512)]                 # (sequences, tokens each), fresh
EXTEND_SHAPE = (4, 4096, 1024)                                      # sequences, cached, new
DECODE_SWEEP = [(64, 4, 2), (64, 4, 4), (128, 4, 3), (128, 4, 2), (32, 4, 3), (64, 8, 3)]   # block_n, warps, stages
PREFILL_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4),
                 (64, 128, 4, 3)]                                                      # block_m, block_n, warps, stages
NH, NKV, HD, BS = 32, 8, 128, 16


def _time_ms(torch, fn: Callable[[], Any], iters: int, rounds: int, graph: bool = False) -> float:
    """Median over rounds of the mean time of `iters` back-to-back calls, by CUDA events. graph:
    the iters calls captured in one CUDA graph first, so host launch costs drop out (falls back
    to plain calls where capture fails)."""
    fn()
    run, n = fn, iters
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(iters):
                    fn()
            run, n = g.replay, 1
        except RuntimeError as e:
            torch.cuda.synchronize()
            print(f"(timing without a graph: {str(e).splitlines()[0][:100]})", flush=True)
    run()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def copy_bandwidth(torch, rounds: int) -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    from kvyard.bench.gpu_step import DEV, DTYPE

    src = torch.randn(1 << 30, dtype=DTYPE, device=DEV)
    dst = torch.empty_like(src)
    ms = _time_ms(torch, lambda: dst.copy_(src), 10, rounds)
    n = src.numel() * 2 * 2
    del src, dst
    return n / (ms * 1e-3)


def _paged(torch, seqs: int, ctx: int) -> tuple[Any, Any, Any]:
    """A cache whose blocks are a random permutation (scattered), filled with random K/V."""
    from kvyard.bench.gpu_step import DEV, DTYPE

    nb = -(-ctx // BS)
    cache = torch.randn(2, seqs * nb + 1, BS, NKV, HD, dtype=DTYPE, device=DEV)
    tables = torch.randperm(seqs * nb, device=DEV).view(seqs, nb).to(torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device=DEV)
    return cache, tables, lens


def _sdpa_backends(torch, call: Callable[[], Any], iters: int, rounds: int) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res: dict[str, Any] = {}
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            with sdpa_kernel(be):
                res[name] = _time_ms(torch, call, iters, rounds, graph=True)
        except RuntimeError as e:  # backend refuses this shape or GQA
            res[name] = f"unsupported: {str(e).splitlines()[0][:120]}"
    return res


def decode_kernels(torch, rounds: int, sweep: bool) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from kvyard.bench.gpu_step import DEV, DTYPE
    from kvyard.workers.attention.triton_decode import DecodeConfig, DecodeWorkspace, decode_config, paged_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B, ctx in DECODE_SHAPES:
        nbytes = 2 * B * ctx * NKV * HD * 2 + 2 * B * NH * HD * 2
        q4 = torch.randn(B, NH, 1, HD, dtype=DTYPE, device=DEV)
        k, v = torch.randn(2, B, NKV, ctx, HD, dtype=DTYPE, device=DEV)
        sdpa = _sdpa_backends(torch, lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
                              10, rounds)
        ref = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).float()
        del k, v
        cache, tables, lens = _paged(torch, B, ctx)
        # the paged cache holds other values than k, v above: correctness is the tests' job,
        # here only bytes and time matter; q is the same
        q = q4[:, :, 0]
        out = torch.empty_like(q)
        cfg = decode_config(B, NKV, tables.shape[1] * BS, sms)
        configs = [cfg]
        if sweep:
            configs += [DecodeConfig(cfg.num_splits, *c) for c in DECODE_SWEEP]
            configs += [DecodeConfig(s, cfg.block_n, cfg.num_warps, cfg.num_stages)
                        for s in {cfg.num_splits * 2, max(1, cfg.num_splits // 2)} - {cfg.num_splits}]
        timed = []
        for c in configs:
            ws = DecodeWorkspace.allocate(B, NH, HD, c.num_splits, DEV) if c.num_splits > 1 else None
            ms = _time_ms(torch, lambda: paged_decode(q, cache, tables, lens, HD ** -0.5, out=out, config=c,
                                                      workspace=ws), 10, rounds, graph=True)
            timed.append((ms, c))
        best_sdpa = min((t for t in sdpa.values() if isinstance(t, float)), default=math.nan)
        ms0, best = timed[0][0], min(timed, key=lambda t: t[0])
        rows.append(dict(batch=B, context=ctx, gb=nbytes / 1e9, kvyard_ms=ms0, kvyard_tbs=nbytes / ms0 / 1e9,
                         config=_cfg(cfg), sdpa_ms=sdpa, sdpa_best_ms=best_sdpa,
                         sdpa_tbs=nbytes / best_sdpa / 1e9, ratio=best_sdpa / ms0,
                         best_config=_cfg(best[1]), best_ms=best[0], best_ratio=best_sdpa / best[0],
                         sweep=[dict(config=_cfg(c), ms=t) for t, c in timed[1:]],
                         ref_finite=bool(torch.isfinite(ref).all())))
        del cache, tables, lens, q4, q, out, ref
        torch.cuda.empty_cache()
    return rows


def _cfg(c: Any) -> dict[str, int]:
    return {k: getattr(c, k) for k in c.__slots__}


def prefill_kernels(torch, rounds: int, sweep: bool) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from kvyard.bench.gpu_step import DEV, DTYPE
    from kvyard.workers.attention.triton_prefill import PrefillConfig, paged_prefill, prefill_config

    rows = []
    shapes = [(B, 0, L) for B, L in PREFILL_SHAPES] + [EXTEND_SHAPE]
    for B, cached, new in shapes:
        ctx = cached + new
        flops = 4 * B * NH * HD * new * (cached + (new + 1) / 2)   # causal: query i sees cached + i + 1 keys
        q = torch.randn(B * new, NH, HD, dtype=DTYPE, device=DEV)
        row: dict[str, Any] = dict(seqs=B, cached=cached, new=new, tflop=flops / 1e12)
        if cached == 0:
            q4 = q.view(B, new, NH, HD).transpose(1, 2)
            k, v = torch.randn(2, B, NKV, new, HD, dtype=DTYPE, device=DEV)
            row["sdpa_ms"] = _sdpa_backends(
                torch, lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True), 5, rounds)
            flash = row["sdpa_ms"].get("flash")
            row["flash_ms"] = flash if isinstance(flash, float) else math.nan
            row["flash_tflops"] = flops / row["flash_ms"] / 1e9
            del k, v
        cache, tables, lens = _paged(torch, B, ctx)
        qsl = torch.arange(0, B + 1, dtype=torch.int32, device=DEV) * new
        out = torch.empty_like(q)
        cfg = prefill_config(HD)
        configs = [cfg] + ([PrefillConfig(*c) for c in PREFILL_SWEEP] if sweep else [])
        timed = []
        for c in configs:
            ms = _time_ms(torch, lambda: paged_prefill(q, cache, tables, qsl, lens, HD ** -0.5, max_query_len=new,
                                                      out=out, config=c), 5, rounds, graph=True)
            timed.append((ms, c))
        ms0, best = timed[0][0], min(timed, key=lambda t: t[0])
        row.update(kvyard_ms=ms0, kvyard_tflops=flops / ms0 / 1e9, config=_cfg(cfg), best_config=_cfg(best[1]),
                   best_tflops=flops / best[0] / 1e9, sweep=[dict(config=_cfg(c), ms=t) for t, c in timed[1:]],
                   finite=bool(torch.isfinite(out).all()))
        if cached == 0:
            row.update(ratio=row["flash_ms"] / ms0, best_ratio=row["flash_ms"] / best[0])
        rows.append(row)
        del cache, tables, lens, q, out
        torch.cuda.empty_cache()
    return rows
