"""gpu_lora_tune's choice of a LoRA launch tile, on made-up timings (the timing itself needs a GPU)."""
from __future__ import annotations

from tests.workers.test_lora_triton import CUDA  # noqa: F401  sets TRITON_INTERPRET=1 without a GPU, before kernels import

from kvyard.bench.gpu_lora_tune import GRID, choose, grid  # noqa: E402
from kvyard.workers.lora.triton_lora import TILE  # noqa: E402


def test_grid_holds_the_shipped_tile_and_every_combination():
    tiles = grid()
    assert TILE in tiles and len(set(tiles)) == len(tiles)
    n = 1
    for v in GRID.values():
        n *= len(v)
    assert len(tiles) == n


def test_choose_takes_the_best_geomean_over_cases_timed_everywhere():
    shipped, fast, faster_once = (512, 64, 4, 4), (256, 128, 2, 8), (1024, 256, 4, 4)
    times = {"qkv": {shipped: 2.0, fast: 1.0, faster_once: 0.5},
             "down": {shipped: 2.0, fast: 1.0}}               # faster_once is missing here
    got = choose(times, shipped)
    assert got == {"tile": list(fast), "geomean_speedup": 2.0}
    slower = {"qkv": {shipped: 1.0, fast: 2.0}}
    assert choose(slower, shipped) == {"tile": list(shipped), "geomean_speedup": 1.0}
    assert choose({}, shipped)["tile"] == list(shipped)
