"""`kvyard bench connector`: the worker-side KV connector with CUDA caches, as it
runs (pinned host memory, DRAM hits loaded in place), against the same
connector with every load staged, and against staging through pageable
memory, in the same run.

For a demo-model layout and an 8B-class layout (bf16, 16-token blocks), each
measurement moves `--mb` of blocks through `StoreConnector` and a DRAM-only
store: `save` = gather on the GPU + D2H into host frames + the store taking
them (until `save` returns: it synchronizes), `load` = the blocks of the last
save, all DRAM hits, into the cache (until `load` returns). Three
connectors, each with its own DRAM tier:
  pinned        - frames from the PinnedArena; a load copies the hits' frames
                  to the GPU where they lie (one H2D per run of adjacent frames)
  pinned-staged - the same, but loads go store -> pinned staging buffer (a
                  host memcpy) -> H2D, as blocks from SSD or Redis do
  pageable      - the staged path through pageable slabs and buffers
Every save takes fresh hashes, so each DRAM tier (`--dram-gb`) is in steady
state: full, evicting one save's worth per save, which is when the arena must
recycle slabs rather than allocate. Runs are interleaved, order alternating;
a row reports the medians, the median of per-pair pinned/pageable ratios and
their spread. Beside them, the raw copies of the same bytes in one piece
(torch `copy_`, pinned and pageable, and a host memcpy, the floor of a
staged load's fill) say how close the connector comes to the bus. Also
measured: what pinning costs (fresh `cudaHostAlloc`-backed slabs vs the arena
handing out a recycled one).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from kvyard.bench import connector_stall
from kvyard.bench.kvstore import LAYOUTS  # the same two block layouts as the kvstore bench

MODES = ("pinned", "pinned-staged", "pageable")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=int, default=256, help="MB of blocks per save/load")
    p.add_argument("--layouts", default="demo,8b", help=f"comma list of {sorted(LAYOUTS)}")
    p.add_argument("--repeat", type=int, default=9, help="interleaved pinned/pageable pairs")
    p.add_argument("--dram-gb", type=float, default=1.0, help="each connector's DRAM tier")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", action="store_true")
    connector_stall.add_arguments(p)


def _median_rate(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _alloc_costs(torch, np, slabs: int = 8) -> dict:
    """Fresh pinned slabs (cudaHostAlloc through torch's host allocator, each new
    since none is free yet: run first), the same sizes handed back by torch's
    cache, the arena reusing a free slab, and fresh pageable memory faulted in."""
    from kvyard.workers.kvconnector import _SLAB_BYTES, PinnedArena

    out: dict = {"slab_mib": _SLAB_BYTES >> 20}
    torch.zeros(1, device="cuda")  # CUDA's start stays out of the first allocation's time
    torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    held = []
    t0 = time.perf_counter()
    for _ in range(slabs):
        held.append(torch.empty(_SLAB_BYTES, dtype=torch.uint8, pin_memory=True))
    out["pinned_fresh_ms"] = (time.perf_counter() - t0) / slabs * 1e3
    del held
    t0 = time.perf_counter()
    held = [torch.empty(_SLAB_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(slabs)]
    out["pinned_torch_cached_ms"] = (time.perf_counter() - t0) / slabs * 1e3
    del held
    t0 = time.perf_counter()
    for _ in range(slabs):
        a = np.empty(_SLAB_BYTES, dtype=np.uint8)
        a[::4096] = 0  # fault every page in, as a first write would
    out["pageable_fresh_ms"] = (time.perf_counter() - t0) / slabs * 1e3
    arena = PinnedArena(pin=True)
    frame = 1 << 20
    per = _SLAB_BYTES // frame
    t, f = arena.carve(frame, per)  # one slab, full; then each carve reuses it
    del t, f
    t0 = time.perf_counter()
    n = 0
    for _ in range(slabs):
        t, f = arena.carve(frame, per)
        rows = list(f)  # what save hands the store
        n += len(rows)
        del t, f, rows
    out["arena_reuse_ms"] = (time.perf_counter() - t0) / slabs * 1e3
    out["arena_slabs"] = arena.nbytes // _SLAB_BYTES
    return out


def _raw_copies(torch, np, dev, nbytes: int, repeat: int) -> dict:
    d = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    arr = np.empty(nbytes, dtype=np.uint8)
    arr.fill(1)
    pageable = torch.from_numpy(arr)
    arr2 = np.empty(nbytes, dtype=np.uint8)
    arr2.fill(1)

    def t(fn):
        times = []
        for _ in range(repeat + 1):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return _median_rate(nbytes, times[1:])

    return {"d2h_pinned": t(lambda: pinned.copy_(d, non_blocking=True)),
            "d2h_pageable": t(lambda: pageable.copy_(d, non_blocking=True)),
            "h2d_pinned": t(lambda: d.copy_(pinned, non_blocking=True)),
            "h2d_pageable": t(lambda: d.copy_(pageable, non_blocking=True)),
            "memcpy": t(lambda: np.copyto(arr2, arr))}


def _layout(report, args, torch, np, lname: str) -> None:
    from kvyard.kvstore import StoreConfig
    from kvyard.workers.kvconnector import StoreConnector

    layers, heads, dim = LAYOUTS[lname]
    dev = torch.device(args.device)
    bs = 16
    nb = layers * 2 * bs * heads * dim * 2
    n = max(1, args.mb * 10**6 // nb)
    total = n * nb
    caches = [torch.randn(2, 2 * n, bs, heads, dim, device=dev).to(torch.bfloat16)
              for _ in range(layers)]
    src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
    conns = {}
    for mode in MODES:
        c = StoreConnector(StoreConfig(dram_bytes=int(args.dram_gb * 1e9)), f"bench-{mode}@1",
                           pin_memory=mode != "pageable", direct_loads=mode == "pinned")
        c.bind(caches, bs)
        conns[mode] = c
    nxt = {m: 1 for m in conns}
    last: dict[str, list[int]] = {}

    def save(mode):
        h = list(range(nxt[mode], nxt[mode] + n))
        nxt[mode] += n
        t0 = time.perf_counter()
        conns[mode].save(h, src_ids)
        dt = time.perf_counter() - t0
        last[mode] = h
        return dt

    def load(mode):
        t0 = time.perf_counter()
        got = conns[mode].load(last[mode], dst_ids)
        dt = time.perf_counter() - t0
        assert got == n, (mode, got, n)
        return dt

    warm = math.ceil(args.dram_gb * 1e9 / total) + 2
    for mode in conns:  # fill the tier: from here on every save evicts a save's worth
        for _ in range(warm):
            save(mode)
            load(mode)
        torch.cuda.synchronize(dev)
        for kv in caches:  # what came back is what went out, byte for byte
            assert torch.equal(kv[:, :n].view(torch.uint8), kv[:, n:].view(torch.uint8)), mode
            kv[:, n:].zero_()
    times = {(m, op): [] for m in conns for op in ("save", "load")}
    for i in range(max(1, args.repeat)):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            times[mode, "save"].append(save(mode))
            times[mode, "load"].append(load(mode))
    raw = _raw_copies(torch, np, dev, total, max(3, args.repeat))
    for op, ref in (("save", "d2h"), ("load", "h2d")):
        ratios = [b / a for a, b in zip(times["pinned", op], times["pageable", op])]
        pin = _median_rate(total, times["pinned", op])
        report.add(layout=lname, block_kib=round(nb / 1024, 1), op=op, blocks=n,
                   pinned_gbps=pin, staged_gbps=_median_rate(total, times["pinned-staged", op]),
                   pageable_gbps=_median_rate(total, times["pageable", op]),
                   ratio=statistics.median(ratios),
                   spread=f"{min(ratios):.2f}..{max(ratios):.2f}",
                   raw_pinned_gbps=raw[f"{ref}_pinned"], raw_pageable_gbps=raw[f"{ref}_pageable"],
                   of_raw=pin / raw[f"{ref}_pinned"], memcpy_gbps=raw["memcpy"])
    a = conns["pinned"]
    report.meta.setdefault("footprint", {})[lname] = {
        "arena_mb": a._arena.nbytes / 1e6, "arena_live_slabs": a._arena.live_slabs,
        "dram_mb": a.store.dram.stats.bytes / 1e6, "pinned_fallbacks": a._arena.pinned_fallbacks}
    for c in conns.values():
        c.close()
    del caches, conns
    torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    import json

    import numpy as np
    import torch

    from kvyard.bench.report import Report

    if args.stall:
        return connector_stall.run_stall(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("kvyard bench connector: no CUDA device here (it measures CUDA caches)", flush=True)
        return 2
    report = Report(f"connector with {args.device} caches: pinned vs pageable staging "
                    f"(same path, same run, {args.repeat} interleaved pairs, "
                    f"{args.mb} MB per op, DRAM tier {args.dram_gb} GB)",
                    ["layout", "block_kib", "op", "blocks", "pinned_gbps", "staged_gbps", "pageable_gbps",
                     "ratio", "spread", "raw_pinned_gbps", "raw_pageable_gbps", "of_raw",
                     "memcpy_gbps"])
    alloc = _alloc_costs(torch, np)
    for lname in [x for x in args.layouts.split(",") if x]:
        _layout(report, args, torch, np, lname)
    report.meta.update(alloc=alloc, device=torch.cuda.get_device_name(args.device),
                       torch=torch.__version__, cpus=os.cpu_count())
    report.notes.append(
        "pinned = the connector as it runs (a load's DRAM hits copied to the GPU from its own "
        "pinned frames in place); staged = pinned, every load through the staging buffers "
        "(direct_loads=False); pageable = staged through pageable memory. "
        "ratio = median over pairs of pinned rate / pageable rate; raw_* = one torch copy_ of "
        "the same bytes (save: D2H, load: H2D); of_raw = pinned connector / raw pinned copy; "
        "memcpy = host memcpy of the same bytes (a DRAM hit's copy into staging)")
    report.notes.append(
        f"pinning a {alloc['slab_mib']} MiB slab: fresh {alloc['pinned_fresh_ms']:.2f} ms, "
        f"torch-cached {alloc['pinned_torch_cached_ms']:.3f} ms, arena reuse (carve + rows) "
        f"{alloc['arena_reuse_ms']:.3f} ms; fresh pageable + page faults "
        f"{alloc['pageable_fresh_ms']:.2f} ms")
    for lname, fp in report.meta.get("footprint", {}).items():
        report.notes.append(f"{lname}: arena {fp['arena_mb']:.0f} MB pinned for a DRAM tier "
                            f"holding {fp['dram_mb']:.0f} MB ({fp['arena_live_slabs']} slabs "
                            f"live, {fp['pinned_fallbacks']} pageable fallbacks)")
    if args.json:
        print(json.dumps(report.to_json(), indent=2), flush=True)
    else:
        report.emit(False)
    return 0
