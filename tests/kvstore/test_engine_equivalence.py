"""Greedy tokens are identical whether the prompt's prefix is computed or loaded from
the store, for a second engine whose own prefix cache is empty (demo model)."""
from __future__ import annotations

import pytest

from kvyard.kvstore import StoreConfig
from kvyard.kvstore.redis_tier import RedisTier

engine_mod = pytest.importorskip("kvyard.workers.engine.llm_engine")


@pytest.fixture(scope="module")
def demo_model(demo_gguf):
    from kvyard.common.models import resolve_model
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.engine.model_runner import resolve_dtype
    from kvyard.workers.model import load_model

    model, mcfg = load_model(resolve_model("demo"), resolve_dtype("auto"))
    return model, mcfg, load_tokenizer("demo")


def _generate(demo_model, connector, prompt):
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM

    model, mcfg, tok = demo_model
    cfg = EngineConfig(model="demo", kv_cache_memory_bytes=32 << 20, kv_connector=connector)
    llm = LLM(engine=engine_mod.LLMEngine(cfg, model, mcfg, tok))
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    return out.token_ids, out.num_cached_tokens


def test_tokens_identical_when_loaded_from_each_tier(demo_model, tmp_path, redis_server):
    from kvyard.workers.kvconnector import StoreConnector, model_identity_of

    ident = model_identity_of("demo")
    prompt = [(i * 7919) % 40000 + 100 for i in range(90)]  # 5 full blocks of 16 before the last
    baseline, cached = _generate(demo_model, None, prompt)
    assert cached == 0 and len(baseline) == 12

    full = StoreConfig(dram_bytes=1 << 26, ssd_dir=str(tmp_path), ssd_bytes=1 << 28,
                       redis_url=redis_server.url, redis_password=redis_server.password)
    first = StoreConnector(full, ident)
    tokens, _ = _generate(demo_model, first, prompt)
    assert tokens == baseline and first.saved_blocks >= 5  # + blocks filled by decoding
    assert first.store.flush()
    first.close()

    for tier, cfg in {
        "ssd": StoreConfig(ssd_dir=str(tmp_path), ssd_bytes=1 << 28),
        "redis": StoreConfig(redis_url=redis_server.url, redis_password=redis_server.password),
    }.items():
        c = StoreConnector(cfg, ident)
        tokens, cached = _generate(demo_model, c, prompt)
        assert c.store.stats()[tier]["hits"] == 5, tier
        assert c.loaded_blocks == 5 and cached == 80, tier
        assert tokens == baseline, tier
        c.close()


def test_wrong_identity_loads_nothing(demo_model, tmp_path):
    from kvyard.workers.kvconnector import StoreConnector

    prompt = list(range(300, 360))
    cfg = StoreConfig(ssd_dir=str(tmp_path), ssd_bytes=1 << 28)
    a = StoreConnector(cfg, "SmolLM2-135M-Instruct@aaaaaaaaaaaaaaaa")
    _generate(demo_model, a, prompt)
    assert a.store.flush() and a.saved_blocks >= 3
    b = StoreConnector(cfg, "SmolLM2-135M-Instruct@bbbbbbbbbbbbbbbb")
    _, cached = _generate(demo_model, b, prompt)
    assert cached == 0 and b.loaded_blocks == 0
    a.close()
    b.close()
