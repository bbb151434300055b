"""`python -m kvyard.bench.gpu_serve_modes` on the CPU: a tiny random Llama directory, a real
`kvyard worker` per mode (weights as stored, int8, four LoRA adapters, n-gram speculation), the
streaming client at two levels and the engine-alone baseline beside each (on the GPU host the
same module runs the 8B shape with every mode)."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from kvyard.bench import gpu_serve_modes
from kvyard.bench.gpu_serve_load import Load, Prompts, run_level

TINY = ["--device", "cpu", "--layers", "2", "--hidden", "256", "--intermediate", "512", "--heads", "4",
        "--kv-heads", "2", "--vocab", "512", "--prompt", "24", "--segment", "6", "--new", "6",
        "--requests-per-stream", "2", "--levels", "1", "2", "--worker-args=--num-threads 1"]


def test_every_mode_serves_tokens_beside_its_engine_alone(tmp_path) -> None:
    out = tmp_path / "modes.json"
    modes = ["bf16", "int8", "lora-4", "spec-ngram"]
    assert gpu_serve_modes.main(["--out", str(out), "--modes", *modes, *TINY]) == 0
    doc = json.loads(out.read_text())
    assert doc["card"] == "cpu" and list(doc["modes"]) == modes
    for mode, rec in doc["modes"].items():
        assert "error" not in rec, (mode, rec.get("error"), rec.get("worker_log_tail"))
        assert rec["worker_exit"] == 0 and rec["load_s"] > 0 and rec["engine_load_s"] > 0
        assert set(rec["levels"]) == set(rec["engine_tok_s"]) == {"1", "2"}
        for c, lvl in rec["levels"].items():
            assert lvl["requests"] == 2 * int(c) and not lvl["truncated"]
            assert lvl["tok_s"] > 0 and rec["engine_tok_s"][c] > 0
            assert 0 < lvl["ttft_p50"] <= lvl["ttft_p99"] and 0 < lvl["tpot_p50"] <= lvl["tpot_p99"]
            assert lvl["vs_engine"] == pytest.approx(lvl["tok_s"] / rec["engine_tok_s"][c])
    assert doc["modes"]["int8"]["flags"] == ["--quantization", "int8"]
    lora = doc["modes"]["lora-4"]["flags"]
    assert lora[:5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"] and len(lora) == 10
    # repeated prompt segments give n-gram proposals; the worker's counters were read
    spec = doc["modes"]["spec-ngram"]["levels"].values()
    assert sum(lvl["draft_tokens"] for lvl in spec) > 0
    assert all(0 <= lvl["acceptance"] <= 1 for lvl in spec if lvl["draft_tokens"])


def test_the_model_dir_is_a_llama_checkpoint_the_engine_decodes_as_transformers(tmp_path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from kvyard.bench.gpu_serve_engine import engine_from_flags
    from kvyard.workers.engine.api import SamplingParams

    p = argparse.ArgumentParser()
    gpu_serve_modes.add_arguments(p)
    a = p.parse_args(["--out", "-", "--layers", "2", "--hidden", "128", "--intermediate", "256", "--heads", "4",
                      "--kv-heads", "2", "--vocab", "300"])
    d = tmp_path / "model"
    gpu_serve_modes.write_model_dir(torch, d, gpu_serve_modes.model_config(a), "cpu", torch.float32)
    prompt = Prompts(300, 12, 4, seed=3)()
    assert prompt[:4] == prompt[4:8] == prompt[8:]
    hf = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    want = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8,
                       min_new_tokens=8, pad_token_id=0)[0, len(prompt):].tolist()
    engine = engine_from_flags(["--model", str(d), "--device", "cpu", "--dtype", "float32",
                                "--kv-cache-memory-bytes", "16MiB", "--num-threads", "1"])
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished_requests():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == want


def test_a_spent_budget_skips_modes_and_still_writes_the_json(tmp_path) -> None:
    out = tmp_path / "modes.json"
    assert gpu_serve_modes.main(["--out", str(out), "--modes", "bf16", "fp8", "--budget-s", "0", *TINY]) == 0
    doc = json.loads(out.read_text())
    assert all("time budget" in doc["modes"][m]["skipped"] for m in ("bf16", "fp8"))


def test_a_level_past_its_deadline_sends_nothing_and_says_truncated() -> None:
    # nothing listens on port 1: a request sent would fail the level
    r = asyncio.run(run_level(Load("http://127.0.0.1:1", 3, 2, 4, Prompts(100, 8), deadline=0.0)))
    assert r["requests"] == 0 and r["truncated"] and r["tok_s"] == 0.0
