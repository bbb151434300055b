"""int8 / fp8 / fp8_e4m3 KV caches on CUDA (skipped without a GPU): the engine with decode CUDA graphs
stays as close to its bf16-KV self as the CPU bounds require, graphs and eager agree,
and a prefix-cache hit reproduces the from-scratch tokens."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from kvyard.workers.attention import kv_quant  # noqa: E402
from kvyard.workers.engine import kv_quant_eval  # noqa: E402
from kvyard.workers.engine.api import SamplingParams  # noqa: E402
from kvyard.workers.engine.config import EngineConfig  # noqa: E402
from kvyard.workers.engine.llm import LLM  # noqa: E402



@pytest.fixture(autouse=True)
def _demo_installed() -> None:
    from kvyard.common.models import ModelNotFound, resolve_model

    try:
        resolve_model("demo")
    except ModelNotFound:
        pytest.skip("the demo model is not installed")


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BOUNDS = {"int8": (0.9, 0.01), "fp8": (0.85, 0.03), "fp8_e4m3": (0.85, 0.03)}


def _llm(kv: str, eager: bool = False, prefix: bool = True) -> LLM:
    return LLM(EngineConfig(model="demo", device="cuda", kv_cache_dtype=kv, enforce_eager=eager,
                            enable_prefix_caching=prefix, kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.5))


@pytest.mark.parametrize("kv", list(BOUNDS))
def test_graphs_eager_and_prefix_hits_agree(kv: str) -> None:
    graphs, eager = _llm(kv), _llm(kv, eager=True)
    assert kv_quant.format_of(graphs.engine.runner.kv_caches[0]) is kv_quant.resolve_kv_format(kv)
    prompts = kv_quant_eval.prompts_of(graphs, kv_quant_eval.QUESTIONS[:3])
    a = [o.token_ids for o in graphs.generate(prompts, GREEDY)]
    assert a == [o.token_ids for o in eager.generate(prompts, GREEDY)]
    again = graphs.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == a and all(o.num_cached_tokens > 0 for o in again)


def test_accuracy_stays_close_to_auto() -> None:
    engines = {kv: _llm(kv, prefix=False) for kv in ("auto", *BOUNDS)}
    prompts = kv_quant_eval.prompts_of(engines["auto"], kv_quant_eval.QUESTIONS[:3])
    for kv, (agree, kl) in BOUNDS.items():
        r = kv_quant_eval.compare(engines["auto"], engines[kv], kv, prompts, 24)
        assert r.top1_agreement >= agree and r.mean_kl <= kl, r
