"""`kvyard bench slo --repeat N`: per-policy medians over paired repeats, with the range,
in the table and in the --json keys."""
from __future__ import annotations

from kvyard.bench.slo import _table
from kvyard.bench.slo_repeat import merge_policy, merge_predictor


def _row(rate: float, goodput: float, inter: float) -> dict:
    return {"rate": rate, "goodput": goodput, "attainment": {"interactive": inter, "batch": 1.0},
            "ttft_p50": 0.1, "ttft_p90": goodput / 100, "ttft_p99": 0.3, "tpot_p50": 0.01,
            "tpot_p90": 0.02, "tpot_p99": 0.03, "shed": int(goodput), "errors": 0,
            "hit_rate": 0.9, "requests": 100}


def test_repeats_merge_to_medians_with_their_range():
    runs = [[_row(100, 50, 0.9), _row(200, g, a)] for g, a in ((3, 0.1), (80, 0.7), (60, 0.5))]
    rows = merge_policy(runs)
    top = rows[-1]
    assert top["goodput"] == 60 and top["attainment"]["interactive"] == 0.5
    assert (top["goodput_min"], top["goodput_max"]) == (3, 80)
    assert (top["att_interactive_min"], top["att_interactive_max"]) == (0.1, 0.7)
    assert top["shed"] == 60 and top["repeats"] == 3 and rows[0]["goodput"] == 50
    pred = merge_predictor([{"ttft": {"samples": 10, "mape": m, "p90_coverage": 0.9}}
                            for m in (0.2, 0.4, 0.3)])
    assert pred["ttft"] == {"samples": 30, "mape": 0.3, "p90_coverage": 0.9}
    doc = {"by_rate": {"p": rows}, "config": {"repeat": 3}, "predictor": {}, "autoscale": {},
           "epp_cost": {}, "cpu_workers": None}
    table = _table(doc)
    assert "medians of 3 paired repeats" in table and "3.0-80.0" in table and "0.10-0.70" in table
