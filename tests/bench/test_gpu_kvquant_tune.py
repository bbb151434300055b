"""The quantized-KV tuning harness (kvyard/bench/gpu_kvquant_tune.py) without a GPU: its selection
on fake timings, its grid, and one pass of its plumbing over the real kernels under
TRITON_INTERPRET=1 (a fake timer; the correctness check is real)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.workers.test_triton_attention import CUDA  # sets TRITON_INTERPRET=1 without a GPU, before kernels import

from kvyard.bench.gpu_kvquant_tune import (  # noqa: E402
    VARIANTS, Tile, Trial, plan, run, select, shape_lines, tiles,
)

SPLITS = {"1x32768": 33, "64x1024": 1}
NBYTES = {sh: {"bf16": 2000, "fp8": 1000, "int8": 1000} for sh in SPLITS}


def _r(shape: str, fmt: str, variant: str, tile: tuple[int, int, int], ms: float | None, err: float | None = 0.03,
       error: str | None = None) -> dict:
    return {"shape": shape, "fmt": fmt, "variant": variant, "block_n": tile[0], "num_warps": tile[1],
            "num_stages": tile[2], "ms": ms, "rel_err": err, "error": error}


def _fake() -> list[dict]:
    a, b = "1x32768", "64x1024"
    return [
        _r(a, "bf16", "bf16", (128, 4, 3), 0.040, 0.001), _r(a, "bf16", "bf16", (64, 4, 3), 0.050, 0.0),
        _r(a, "bf16", "bf16", (32, 4, 3), 0.010, err=0.3),             # a broken bf16 tile
        _r(b, "bf16", "bf16", (64, 4, 3), 0.100, 0.0),
        _r(a, "fp8", "words", (128, 4, 3), 0.060), _r(a, "fp8", "asm", (128, 4, 3), 0.030),
        _r(a, "fp8", "asm", (64, 8, 2), 0.028), _r(a, "fp8", "bytes", (128, 4, 3), 0.029),
        _r(a, "fp8", "win", (128, 4, 3), 0.010, err=0.5),            # fast but wrong: rejected
        _r(a, "fp8", "bytes_t", (64, 4, 3), None, error="CompilationError: boom"),
        _r(b, "fp8", "words", (64, 4, 3), 0.200), _r(b, "fp8", "asm", (64, 4, 3), 0.070),
        _r(b, "fp8", "asm", (64, 8, 2), 0.080), _r(b, "fp8", "bytes", (64, 4, 3), 0.060),
        _r(a, "int8", "words", (64, 4, 3), 0.050, err=0.01), _r(b, "int8", "words", (64, 4, 3), 0.150, err=0.01),
    ]


def test_select_picks_bests_rejects_wrong_results_and_suggests_defaults() -> None:
    rep = select(_fake(), list(SPLITS), ["fp8", "int8"], NBYTES, SPLITS)
    assert rep["bf16_best"]["1x32768"]["block_n"] == 128 and rep["bf16_best"]["1x32768"]["ms"] == 0.040
    assert rep["rejected"] == 1
    a = rep["shapes"]["1x32768"]["fp8"]
    assert a["best"]["variant"] == "asm" and a["best"]["num_warps"] == 8   # win was faster but wrong
    assert a["err_limit"] == 0.06 and "win" not in a["by_variant"] and "bytes_t" not in a["by_variant"]
    # per byte: (1000 / 0.028) / (2000 / 0.040)
    assert a["best"]["per_byte_vs_bf16"] == round((1000 / 0.028) / (2000 / 0.040), 3)
    assert rep["shapes"]["64x1024"]["fp8"]["best"]["variant"] == "bytes"
    s = rep["summary"]["fp8"]
    # geomean of ms / per-shape best: asm sqrt(1 * 70/60), bytes sqrt(29/28 * 1), words far behind
    assert s["best_variant"] == "bytes"
    assert s["best_config_by_shape"]["1x32768"]["block_n"] == 128
    want = math.sqrt(((1000 / 0.029) / (2000 / 0.040)) * ((1000 / 0.060) / (2000 / 0.100)))
    assert s["attn_throughput_per_byte_vs_bf16"] == round(want, 3)
    assert set(s["per_byte_vs_bf16_by_variant"]) == {"words", "asm", "bytes"}
    d = rep["suggested_defaults"]["fp8"]
    assert d["split"] == {"variant": "asm", "block_n": 64, "num_warps": 8, "num_stages": 2,
                          "slowdown_vs_per_shape_best": 1.0}
    assert d["unsplit"]["variant"] == "bytes" and d["unsplit"]["block_n"] == 64
    assert rep["summary"]["int8"]["best_variant"] == "words"
    lines = shape_lines(rep, ["fp8", "int8"])
    assert len(lines) == 2 and "asm [64,8,2]" in lines[0] and "bf16 0.0400 ms" in lines[0]


def test_select_without_words_uses_the_fallback_limit_and_tolerates_gaps() -> None:
    rows = [r for r in _fake() if r["variant"] != "words" and r["shape"] == "1x32768"]
    rep = select(rows, ["1x32768", "64x1024"], ["fp8", "int8"], NBYTES, SPLITS)
    assert rep["shapes"]["1x32768"]["fp8"]["err_limit"] == 0.08
    assert rep["shapes"]["64x1024"]["fp8"]["best"] is None and rep["bf16_best"]["64x1024"] is None
    assert rep["summary"]["fp8"]["best_variant"] is None
    assert rep["suggested_defaults"]["fp8"]["split"]["variant"] == "asm"
    assert "unsplit" not in rep["suggested_defaults"]["fp8"]


def test_grid_is_pruned_and_ordered_by_prior() -> None:
    grid = tiles()
    assert len(grid) == 24 and Tile(32, 8, 3) not in grid and len(set(grid)) == 24
    assert grid[0] == Tile(64, 4, 3) and grid[1] == Tile(128, 4, 3)
    trials = plan(["a", "b"], ["fp8"], ["words", "asm"], grid[:2])
    assert trials[:3] == [Trial("a", "bf16", "bf16", grid[0]), Trial("a", "fp8", "words", grid[0]),
                          Trial("a", "fp8", "asm", grid[0])]
    assert all(t.tile == grid[0] for t in trials[:6]) and len(trials) == 12


def test_run_over_the_interpreted_kernels() -> None:
    """Every variant runs at the 8B attention shape (8 KV heads: "win" reads aligned windows)
    and passes the error check against bf16's kernel (here float16: the interpreter has no
    bfloat16); the report is complete."""
    if CUDA:
        pytest.skip("the GPU runs the harness itself")
    times = iter(range(1, 1000))
    # one compile thread: the pool's plumbing runs, and the interpreter (not thread-safe) runs alone
    rep = run(torch, [(1, 40)], ["fp8", "int8"], VARIANTS, [Tile(16, 4, 1)], 1e9,
              timer=lambda fn: next(times) / 100, dev="cpu", dtype=torch.float16, threads=1)
    assert rep["errors"] == {} and rep["rejected"] == 0 and rep["skipped"] == 0
    row = rep["shapes"]["1x40"]
    for f in ("fp8", "int8"):
        assert set(row[f]["by_variant"]) == set(VARIANTS)
        assert row[f]["best"]["variant"] == "words"   # the fake timer's first quantized trial
        assert 0 < row[f]["best"]["rel_err"] < {"fp8": 0.06, "int8": 0.02}[f]
    assert rep["summary"]["int8"]["best_variant"] == "words"
    assert rep["suggested_defaults"]["fp8"]["unsplit"]["block_n"] == 16
