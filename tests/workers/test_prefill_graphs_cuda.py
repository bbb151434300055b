"""Prefill/extend CUDA graphs against eager steps and HF transformers (skipped without CUDA).

float32, one prompt per step so that every prefill is a one-sequence step the graphs take:
greedy tokens equal HF's, and the graphs really ran (prompts of several buckets, a chunked
prompt past the largest bucket, and an extend over a cached prefix).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from kvyard.common.models import resolve_model  # noqa: E402
from kvyard.workers.engine.api import SamplingParams  # noqa: E402
from kvyard.workers.engine.config import EngineConfig  # noqa: E402
from kvyard.workers.engine.llm import LLM  # noqa: E402
from kvyard.workers.engine.llm_engine import LLMEngine  # noqa: E402

from .test_cuda_engine import _hf_tokens, _prompts, _same, tiny_dir  # noqa: E402,F401


def test_prefill_graphs_greedy_equal_transformers_float32(tiny_dir) -> None:
    from kvyard.workers.model import load_model

    path, hf = tiny_dir
    hf = hf.to("cuda")
    model, cfg = load_model(resolve_model(str(path)), torch.float32, 4096, device="cuda")
    conf = EngineConfig(model=str(path), dtype="float32", device="cuda", max_model_len=4096, max_num_seqs=8,
                        kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=256)
    engine = LLMEngine(conf, model, cfg, None)
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and graphs.sizes[-1] == 256
    runs = []
    real_run = graphs.run
    graphs.run = lambda ids, *a: runs.append(len(ids)) or real_run(ids, *a)
    prompts = _prompts(512, lengths=(5, 17, 100, 300))
    prompts.append(prompts[2] + prompts[0])  # an extend over the third prompt's cached prefix
    llm = LLM(engine=engine)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert _same(got, _hf_tokens(hf, prompts, 16))
    assert {5, 17, 100, 256, 44, 9}.issubset(set(runs))  # 300 = 256 + 44; the extend: 105 - 96 cached
