"""gpu_kvquant's choice of fp8_e4m3's launch (pick_bare) on made-up timings, and how paged_decode
scales decode_config's splits for that format (triton_decode_bare.splits_for)."""
from __future__ import annotations

from tests.workers.test_triton_attention import CUDA  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)

from kvyard.bench.gpu_kvquant import pick_bare  # noqa: E402
from kvyard.workers.attention import triton_decode_bare  # noqa: E402


def test_pick_bare_takes_the_best_geomean_among_keys_timed_everywhere() -> None:
    w, b, m = ("words", 64, 4, 2, 1), ("bytes", 128, 4, 2, 1), ("bytes", 128, 4, 2, 4)
    times = {
        "split": {"1x32768": {b: 0.040, m: 0.034, w: 0.039}, "8x8192": {b: 0.063, m: 0.061, w: 0.070}},
        # w is fastest at one unsplit shape but was not timed at the other (a failed compile)
        "unsplit": {"64x2048": {w: 0.100, b: 0.120}, "128x1024": {b: 0.115, ("mixed", 128, 4, 3, 1): 0.112}},
    }
    pick = pick_bare(times)
    assert pick["split"] == {"variant": "bytes", "tile": [128, 4, 2], "splits_x": 4,
                             "slowdown_vs_per_shape_best": 1.0}
    assert pick["unsplit"]["variant"] == "bytes" and pick["unsplit"]["tile"] == [128, 4, 2]
    assert pick["unsplit"]["slowdown_vs_per_shape_best"] > 1.0
    assert pick_bare({"split": {}, "unsplit": {"a": {w: 1.0}, "b": {b: 1.0}}}) == {}, "nothing timed everywhere"


def test_splits_for_scales_only_split_launches(monkeypatch) -> None:
    monkeypatch.setattr(triton_decode_bare, "SPLITS_X", 4)
    assert triton_decode_bare.splits_for(1, 2048) == 1            # an unsplit launch stays unsplit
    assert triton_decode_bare.splits_for(5, 8192) == 20
    assert triton_decode_bare.splits_for(33, 32768) == 64         # at most 64
    assert triton_decode_bare.splits_for(2, 512) == 4             # at least 128 tokens a split
    monkeypatch.setattr(triton_decode_bare, "SPLITS_X", 1)
    assert triton_decode_bare.splits_for(5, 8192) == 5


def test_the_engine_launches_the_tunes_gluon_ring_and_use_triton_the_triton_picks(monkeypatch) -> None:
    from kvyard.bench.gpu_kvquant import BARE_GRID, use_triton

    tile, splits_x = triton_decode_bare.RING
    assert tile[0] == triton_decode_bare.GLUON and tile in BARE_GRID, "the tune can pick the ring it names"
    if triton_decode_bare.gluon_decode_bare is not None:
        assert triton_decode_bare.TILES == {"split": tile, "unsplit": tile}
        assert triton_decode_bare.SPLITS_X == splits_x == 2
    monkeypatch.setattr(triton_decode_bare, "TILES", dict(triton_decode_bare.TILES))
    monkeypatch.setattr(triton_decode_bare, "SPLITS_X", triton_decode_bare.SPLITS_X)
    assert use_triton() == "bytes/128/4/2 splits x4, unsplit words/64/4/2"
    assert triton_decode_bare.TILES == triton_decode_bare.TRITON_TILES
    assert triton_decode_bare.SPLITS_X == triton_decode_bare.TRITON_SPLITS_X == 4
