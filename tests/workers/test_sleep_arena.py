"""Sleep mode's fixed-address arenas (engine/sleep_arena.py, engine/cuda_vmm.py).

On the CPU: `pack` moves a set of tensors into one buffer keeping every value, view,
tie and dtype. On CUDA (skipped without a GPU): a VMM buffer keeps its address across
release/map; an engine's sleep (levels 1 and 2) and wake keep the same decode CUDA
graphs and give the same greedy tokens, and the memory really goes back while asleep.
"""
from __future__ import annotations

import gc

import pytest
import torch

from kvyard.workers.engine.sleep_arena import ALIGN, distinct_storages, layout, pack
from kvyard.workers.engine.sleep_mode import _tensors


class _Holder:  # a kvyard-style object outside nn.Module (the walk must find it)
    __module__ = "kvyard.test"
    __slots__ = ("w", "view")

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.view = w, w[1:, ::2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=True))
    m[1].weight = m[0].weight          # tied head
    m.register_buffer("table", torch.randn(7, 3, dtype=torch.float64))
    m.extra = _Holder(torch.randn(5, 6).to(torch.bfloat16))
    return m


def test_pack_keeps_values_views_ties_and_dtypes() -> None:
    with torch.inference_mode():
        m = _model()
        ts = _tensors(m)
        before = {id(t): t.clone() for t in ts}
        x = torch.randint(0, 50, (9,))
        want = m(x)
        n_storages = len(distinct_storages(ts, "cpu"))
        assert n_storages == 4              # embed (tied with the head), bias, table, extra.w (+ its view)
        buf, offs, sizes = pack(ts, "cpu", lambda n: torch.full((n,), 0xAB, dtype=torch.uint8))
        assert len(offs) == len(sizes) == n_storages
        assert all(o % ALIGN == 0 for o in offs)
        assert offs == sorted(offs) and all(a + s <= b for a, s, b in zip(offs, sizes, offs[1:]))
        for t in ts:
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert torch.equal(t, before[id(t)])
        assert m[1].weight is m[0].weight
        view = m.extra.view
        assert view.data_ptr() == m.extra.w.data_ptr() + 6 * 2 and view.stride() == (6, 2)
        assert torch.equal(m(x), want)
        m.extra.w[1, 0] = 3.0                  # still a view of the same bytes
        assert m.extra.view[0, 0].item() == 3.0


def test_layout_sizes_and_alignment() -> None:
    ss = [torch.empty(n, dtype=torch.uint8).untyped_storage() for n in (1, 256, 257, 0 + 10)]
    offs, total = layout(ss)
    assert offs == [0, 256, 512, 1024] and total == 1280


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_vmm_buffer_keeps_its_address_across_release_and_map() -> None:
    from kvyard.workers.engine.cuda_vmm import VmmBuffer

    n = (3 << 20) + 123
    b = VmmBuffer(n, torch.device("cuda"), chunk=2 << 20)
    b.map()
    t = b.tensor()
    ptr = t.data_ptr()
    assert t.numel() == n and b.mapped and b.mapped_bytes >= n
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    t.copy_(src)
    assert torch.equal(t, src)
    free0 = torch.cuda.mem_get_info()[0]
    b.release()
    torch.cuda.synchronize()
    assert not b.mapped and torch.cuda.mem_get_info()[0] >= free0 + (4 << 20)
    b.map()
    assert b.tensor().data_ptr() == ptr
    t.copy_(src)                     # the old tensor object works on the new memory
    assert torch.equal(t, src)
    del t, b, src
    gc.collect()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-sleep")
    LlamaForCausalLM(cfg).float().save_pretrained(d, safe_serialization=True)
    return str(d)


@cuda
def test_engine_sleep_and_wake_keep_the_graphs_and_the_tokens(tiny_dir) -> None:
    from kvyard.common.models import resolve_model
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model(tiny_dir), torch.float32, 4096, device="cuda")
    conf = EngineConfig(model=tiny_dir, dtype="float32", device="cuda", max_model_len=4096,
                        max_num_seqs=8, kv_cache_memory_bytes=64 << 20)
    llm = LLM(engine=LLMEngine(conf, model, cfg, None))
    del model
    eng = llm.engine
    assert eng.runner.arenas is not None and eng.runner.graphs is not None
    # the KV cache is an ordinary tensor: the connector's load threads write it outside inference mode
    assert not any(t.is_inference() for t in eng.runner.kv_caches)
    eng.runner.kv_caches[0][0, 0].add_(0)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    graphs = eng.runner.graphs
    ptrs = [t.data_ptr() for t in eng.runner.kv_caches]
    for level in (1, 2, 1):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        eng.sleep(level)
        freed = torch.cuda.mem_get_info()[0] - free0
        assert freed >= (64 << 20), freed         # at least the KV cache went back
        eng.wake_up()
        assert eng.runner.graphs is graphs        # not captured again
        assert [t.data_ptr() for t in eng.runner.kv_caches] == ptrs
        assert not any(t.abs().sum().item() for t in eng.runner.kv_caches)   # dropped: zeroed
        assert [o.token_ids for o in llm.generate(prompts, params)] == want, level
        parts = eng._sleep.last_parts       # level 1 from the pinned copy, level 2 from the files
        assert ("h2d_s" in parts) == (level == 1) and ("read_s" in parts) == (level == 2), parts
