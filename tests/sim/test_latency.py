"""The latency model and its profiles (computed values, never wall timings)."""
from __future__ import annotations

import argparse
import json

import pytest

from kvyard.sim.calibrate import fit_line, profile_from
from kvyard.sim.config import duration
from kvyard.sim.latency import LatencyModel
from kvyard.sim.profiles import BUILTIN, LatencyProfile, load_profile


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_ttft_grows_with_uncached_tokens_and_itl_with_the_batch(name: str) -> None:
    m = LatencyModel(load_profile(name), seed=0)
    ttft = [m.prefill_mean(n) for n in (0, 1, 16, 256, 4096)]
    assert ttft == sorted(ttft) and ttft[-1] > ttft[0]
    assert ttft[0] == m.profile.prefill_overhead
    itl = [m.itl_mean(b) for b in (1, 2, 16, 128)]
    assert itl == sorted(itl) and itl[0] == m.profile.inter_token_latency
    assert m.transfer_mean(1000) > m.transfer_mean(10) >= m.profile.kv_transfer_latency
    assert m.profile.source  # every profile says where its numbers come from


def test_jitter_stays_within_llm_d_bounds_and_time_scale_divides() -> None:
    p = LatencyProfile("t", 0.01, 0.001, 0.02, inter_token_latency_std_dev=0.05)
    m = LatencyModel(p, time_scale=10.0, seed=3)
    xs = [m.itl(1) for _ in range(500)]
    assert min(xs) >= 0.02 * 0.3 - 1e-12 and max(xs) <= 0.02 * 1.7 + 1e-12
    assert len(set(xs)) > 1
    assert m.real(1.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        LatencyModel(p, time_scale=0)


def test_profiles_round_trip_and_flags_parse(tmp_path) -> None:
    path = load_profile("h100").save(tmp_path / "p.json")
    assert load_profile(str(path)) == BUILTIN["h100"]
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError):
        load_profile("no-such-profile")
    assert duration("250us") == pytest.approx(250e-6)
    assert duration("100ms") == pytest.approx(0.1) and duration("12") == pytest.approx(0.012)
    assert duration("1.5s") == 1.5
    with pytest.raises(argparse.ArgumentTypeError):
        duration("fast")


def test_calibration_fits_the_measured_points() -> None:
    icpt, slope, res = fit_line([16, 256, 1024], [0.05 + 0.001 * n for n in (16, 256, 1024)])
    assert icpt == pytest.approx(0.05) and slope == pytest.approx(0.001) and res < 1e-9
    ttfts = [(n, 0.02 + 0.0005 * n) for n in (16, 256, 1024) for _ in range(2)]
    prof = profile_from(load_profile("cpu-demo"), ttfts, {1: [0.016, 0.016], 4: [0.028, 0.028]},
                        "mine", "test")
    assert prof.prefill_overhead == pytest.approx(0.02)
    assert prof.prefill_time_per_token == pytest.approx(0.0005)
    assert prof.inter_token_latency == pytest.approx(0.016)
    assert prof.itl_per_running_seq == pytest.approx(0.004)
    assert prof.kv_transfer_latency == BUILTIN["cpu-demo"].kv_transfer_latency
