"""Greedy output with LoRA adapters equals HF transformers + PEFT with the same adapter
(demo model, float32).

Adapters of ranks 4, 8 and 16 are made by PEFT with random non-zero weights (on all
seven projections, on attention only, on the MLP and o only; one with rsLoRA) and saved
in PEFT's format; the engine reads those files. Each adapter alone, all of them mixed
with the base model in one batch (chunked prefills beside decodes), and again with one
device slot and one host copy (adapters swapped in and re-read between steps); then
the caches: blocks are keyed by adapter.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvyard.common.hashing import adapter_seed, block_hashes
from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.llm import LLM
from kvyard.workers.engine.llm_engine import LLMEngine
from kvyard.workers.lora.config import LoRAConfig, LoRAModule

sys.path.insert(0, str(Path(__file__).parent))
from lora_adapters import ALL_MODULES, make_adapters  # noqa: E402

pytestmark = pytest.mark.timeout(900)

NEW_TOKENS = 10
QUESTIONS = ["What is the capital of France?",
             "Write one sentence about the sea, in the style of a pirate captain on a long voyage."]
ADAPTERS = [("r8_all", 8, 16, ALL_MODULES, False),
            ("r4_attn", 4, 8, ["q_proj", "k_proj", "v_proj"], False),
            ("r16_mlp", 16, 16, ["o_proj", "gate_proj", "up_proj", "down_proj"], True)]
NAMES = [a[0] for a in ADAPTERS] + [None]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(prompts, adapter dir, {adapter or None: [HF tokens per prompt]})."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer("demo")
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    p = resolve_model("demo").path
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    out = tmp_path_factory.mktemp("adapters")
    pm = make_adapters(hf, out, ADAPTERS, std=0.1)
    ref: dict[str | None, list[list[int]]] = {}
    with torch.inference_mode():
        for name in NAMES:
            ref[name] = []
            for ids in prompts:
                x = torch.tensor([ids])
                kw = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                          max_new_tokens=NEW_TOKENS, pad_token_id=0)
                if name is None:
                    with pm.disable_adapter():
                        y = pm.generate(**kw)
                else:
                    pm.set_adapter(name)
                    y = pm.generate(**kw)
                ref[name].append(y[0, len(ids):].tolist())
    # the adapters matter: each changes some prompt's output
    for name in NAMES[:-1]:
        assert ref[name] != ref[None], f"adapter {name} leaves the output unchanged: a weak test"
    return prompts, out, ref


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32)
    return model, cfg, load_tokenizer("demo")


def engine(loaded, adapters: Path, max_loras: int, max_cpu_loras: int | None = None, **kw) -> LLM:
    model, cfg, tok = loaded
    lc = LoRAConfig(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras,
                    modules=[LoRAModule(a[0], str(adapters / a[0])) for a in ADAPTERS])
    conf = EngineConfig(dtype="float32", kv_cache_memory_bytes=64 << 20, lora=lc, **kw)
    return LLM(engine=LLMEngine(conf, model, cfg, tok))


def _params(name):
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, lora_name=name)


def _check(llm, prompts, ref, names):
    jobs = [(n, i) for n in names for i in range(len(prompts))]
    outs = llm.generate([prompts[i] for _, i in jobs], [_params(n) for n, _ in jobs])
    for (n, i), o in zip(jobs, outs, strict=True):
        assert o.token_ids == ref[n][i], f"adapter {n}, prompt {i}: {o.token_ids} != PEFT's {ref[n][i]}"
    return outs


def test_each_adapter_alone_matches_peft(loaded, case):
    prompts, adapters, ref = case
    llm = engine(loaded, adapters, max_loras=1, enable_prefix_caching=False)
    for name in NAMES:
        _check(llm, prompts, ref, [name])


def test_adapters_and_base_in_one_batch_match_peft(loaded, case):
    prompts, adapters, ref = case
    # a small token budget: prompts split into chunks that share steps with other adapters' decodes
    llm = engine(loaded, adapters, max_loras=3, max_num_batched_tokens=24, enable_prefix_caching=False)
    steps: list[set] = []
    real_step = llm.engine.step

    def step():
        out = real_step()
        steps.append({s.params.lora_name for s in llm.engine.scheduler.running} - {None})
        return out
    llm.engine.step = step
    _check(llm, prompts, ref, NAMES)
    assert max(len(s) for s in steps) == 3  # three adapters did share a batch


def test_one_slot_swaps_adapters_and_still_matches(loaded, case):
    prompts, adapters, ref = case
    llm = engine(loaded, adapters, max_loras=1, max_cpu_loras=1, max_num_batched_tokens=32)
    running: list[set] = []
    real_step = llm.engine.step

    def step():
        out = real_step()
        running.append({s.params.lora_name for s in llm.engine.scheduler.running} - {None})
        return out
    llm.engine.step = step
    _check(llm, prompts, ref, NAMES)
    assert all(len(r) <= 1 for r in running)  # --max-loras 1: one adapter per batch
    lora = llm.engine.lora
    assert lora.stats.slot_fills >= 3
    # host copies beyond --max-cpu-loras go once no request names them, and come back from disk
    _check(llm, prompts[:1], ref, ["r16_mlp"])
    assert list(lora.host) == ["r16_mlp"]
    loads = lora.stats.loads
    _check(llm, prompts[:1], ref, ["r8_all"])
    assert lora.stats.loads == loads + 1 and list(lora.host) == ["r8_all"]


def test_prefix_cache_and_events_are_keyed_by_adapter(loaded, case):
    prompts, adapters, ref = case
    llm = engine(loaded, adapters, max_loras=2)
    events = []
    llm.engine.add_kv_event_listener(events.append)
    first = _check(llm, prompts[:1], ref, ["r8_all"])[0]
    assert first.num_cached_tokens == 0
    other = _check(llm, prompts[:1], ref, ["r4_attn"])[0]
    assert other.num_cached_tokens == 0        # another adapter's blocks never match
    base = _check(llm, prompts[:1], ref, [None])[0]
    assert base.num_cached_tokens == 0
    again = _check(llm, prompts[:1], ref, ["r8_all"])[0]
    assert again.num_cached_tokens > 0         # the same adapter's do
    stored = [e for e in events if e.kind == "stored"]
    assert {e.lora_name for e in stored} == {"r8_all", "r4_attn", None}
    # the hashes are the shared chain seeded by the adapter's name: any worker (and the
    # kvstore's keys) computes the same ones
    e = next(e for e in stored if e.lora_name == "r4_attn")
    assert e.block_hashes[0] == block_hashes(e.token_ids, e.block_size, seed=adapter_seed("r4_attn"))[0]
    assert adapter_seed("r4_attn") != adapter_seed("r8_all") != adapter_seed(None) == 0


class _CountingKernels:
    """The real C kernels, counting lora.c's calls."""

    def __init__(self, kernels) -> None:
        self.kernels, self.calls = kernels, 0

    def lora_sgmv(self, *args) -> None:
        self.calls += 1
        self.kernels.lora_sgmv(*args)


def test_c_kernel_serves_the_cpu_lora_steps(loaded, case):
    """The steps above run lora.c (workers/cpu_ops): here it is watched doing so, for every
    adapter and the base model mixed in one batch."""
    prompts, adapters, ref = case
    llm = engine(loaded, adapters, max_loras=3, enable_prefix_caching=False)
    cpu = llm.engine.lora.cpu
    assert cpu is not None, "the C kernels did not load: CPU LoRA steps fall back to torch"
    cpu.kernels = counting = _CountingKernels(cpu.kernels)
    _check(llm, prompts, ref, NAMES)
    assert counting.calls > 0
