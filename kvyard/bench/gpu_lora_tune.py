"""Launch shapes of the SGMV LoRA kernels on a GPU: `python3 -m kvyard.bench.gpu_lora_tune --out F.json`.

Runs on the GPU host without kvyard installed (tools/device_gpu.sh's shim). For Llama-3-8B's
four LoRA projections (qkv, o, gate_up, down; rank 16) and three batches (64 rows over 16
adapters, 64 rows over 1, 8 rows over 4), `lora_delta` is timed with every `LoRATile` of a
small grid (inputs per shrink program, output columns per expand program, warps of each),
each call captured in a CUDA graph (gpu_kernels._time_ms), its result checked against the
shipped tile's. Bytes: the used adapters' A and B, x, and y read and written; a time is a
fraction of the HBM roofline those bytes allow (the copy bandwidth measured here).

The JSON: per case the shipped tile's time, the best tile and its speedup, and
`suggested_tile`: the grid's tile with the best geomean speedup over all cases, to paste
into workers/lora/triton_lora.py's `TILE` (only where it beats the shipped one).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict
from typing import Any

from kvyard.bench.gpu_kernels import _geomean

PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BATCHES = ((64, 16), (64, 1), (8, 4))   # (rows, adapters)
RANK = 16
GRID = {"k_per_program": (256, 512, 1024), "max_block_n": (64, 128, 256),
        "shrink_warps": (2, 4), "expand_warps": (4, 8)}


def grid() -> list[Any]:
    from kvyard.workers.lora.triton_lora import LoRATile

    return [LoRATile(*v) for v in itertools.product(*GRID.values())]


def choose(times: dict[str, dict[tuple, float]], shipped: tuple) -> dict[str, Any]:
    """`times`: case -> {tile as a tuple: ms}. The tile with the best geomean speedup over the
    shipped one among tiles timed in every case (pure: tested on made-up timings)."""
    cases = [c for c, t in times.items() if shipped in t]
    full = [k for k in set().union(*(times[c] for c in cases)) if all(k in times[c] for c in cases)]
    if not cases or not full:
        return {"tile": list(shipped), "geomean_speedup": 1.0}
    score = {k: _geomean([times[c][shipped] / times[c][k] for c in cases]) for k in full}
    best = max(score, key=score.get)
    return {"tile": list(best), "geomean_speedup": round(score[best], 3)}


def _case(torch, k: int, n: int, rows: int, adapters: int):
    """One projection's operands: `rows` rows spread over `adapters` slots round robin."""
    from kvyard.workers.lora.triton_lora import BLOCK_M
    from kvyard.workers.lora.batch import TileTable, _groups

    dev = "cuda"
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
    a = torch.randn(adapters, RANK, k, dtype=torch.bfloat16, device=dev) * k ** -0.5
    b = torch.randn(adapters, n, RANK, dtype=torch.bfloat16, device=dev) * 0.01
    y0 = torch.randn(rows, n, dtype=torch.bfloat16, device=dev)
    t = TileTable.build(_groups([i % adapters for i in range(rows)]), rows, adapters, torch.device(dev), BLOCK_M)
    nbytes = 2 * (adapters * RANK * (k + n) + rows * k + 2 * rows * n)
    return x, a, b, y0, t, nbytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=150.0, help="stop timing new tiles after this")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    from kvyard.bench.gpu_kernels import _time_ms, copy_bandwidth
    from kvyard.workers.lora.triton_lora import TILE, lora_delta

    t0 = time.time()
    bandwidth = copy_bandwidth(torch, args.rounds)
    shipped = tuple(asdict(TILE).values())
    tiles = [TILE] + [g for g in grid() if g != TILE]
    times: dict[str, dict[tuple, float]] = {}
    cases: dict[str, Any] = {}
    skipped = 0
    for (name, (k, n)), (rows, adapters) in itertools.product(PROJECTIONS.items(), BATCHES):
        case = f"{name} {rows}x{adapters}"
        x, a, b, y0, t, nbytes = _case(torch, k, n, rows, adapters)
        ref = None
        times[case] = {}
        for tile in tiles:
            if time.time() - t0 > args.budget_s and tile is not TILE:
                skipped += 1
                continue
            y = y0.clone()

            def call(tile=tile, y=y):
                lora_delta(x, a, b, y, t.rows, t.tile_slot, t.tile_start, t.tile_len, tile)
            ms = _time_ms(torch, call, 20, args.rounds, graph=True)
            y = y0.clone()
            call(tile, y)
            if ref is None:
                ref = (y.float() - y0.float())
            err = float(((y.float() - y0.float()) - ref).norm() / ref.norm())
            if err > 1e-2:
                print(f"# {case} {tile}: rejected, error {err:.3g}", flush=True)
                continue
            times[case][tuple(asdict(tile).values())] = ms
        best = min(times[case], key=times[case].get)
        cases[case] = {"bytes": nbytes, "shipped_ms": round(times[case][shipped], 5),
                       "shipped_roofline": round(nbytes / bandwidth / (times[case][shipped] * 1e-3), 3),
                       "best_tile": list(best), "best_ms": round(times[case][best], 5),
                       "speedup": round(times[case][shipped] / times[case][best], 3)}
        print(f"{case}: shipped {cases[case]['shipped_ms']} ms ({cases[case]['shipped_roofline']:.0%} of roofline), "
              f"best {best} {cases[case]['best_ms']} ms (x{cases[case]['speedup']})", flush=True)
    out = {"device": torch.cuda.get_device_name(0), "copy_gb_s": round(bandwidth / 1e9, 1),
           "tile_fields": list(asdict(TILE)), "shipped_tile": list(shipped), "cases": cases,
           "suggested_tile": choose(times, shipped), "skipped_trials": skipped,
           "elapsed_s": round(time.time() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["suggested_tile"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
