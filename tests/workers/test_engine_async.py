"""AsyncLLMEngine on the real demo model: streaming, disconnects, aborts, engine errors."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.async_engine import AsyncLLMEngine, EngineError
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.llm import LLM
from kvyard.workers.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32)
    return model, cfg, load_tokenizer("demo")


def build(loaded, connector=None) -> LLMEngine:
    model, cfg, tok = loaded
    conf = EngineConfig(dtype="float32", kv_cache_memory_bytes=32 << 20, kv_connector=connector)
    return LLMEngine(conf, model, cfg, tok)


@pytest.fixture
async def engine(loaded):
    eng = AsyncLLMEngine(EngineConfig(dtype="float32"), engine=build(loaded))
    await eng.start()
    yield eng
    await eng.shutdown()


def ids(loaded, q: str) -> list[int]:
    return loaded[2].encode_chat([{"role": "user", "content": q}])


async def until(pred, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll with a deadline; the engine thread does the work, we only look."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def collect(eng: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    outs = [o async for o in eng.generate(rid, prompt, params)]
    return outs


async def test_streams_match_the_offline_engine(loaded, engine):
    prompts = [ids(loaded, q) for q in ("Hello!", "Count from one to ten.", "What is rain?")]
    p = SamplingParams(temperature=0.0, max_tokens=10)
    results = await asyncio.gather(*(collect(engine, f"r{i}", x, p) for i, x in enumerate(prompts)))
    offline = LLM(engine=build(loaded)).generate(prompts, p)
    for outs, ref in zip(results, offline):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
        assert "".join(o.text_delta for o in outs) == ref.text
        assert outs[-1].finish_reason == ref.finish_reason
    assert engine.served_model_name and engine.max_model_len > 0 and engine.tokenizer is loaded[2]


async def test_cancelled_consumer_aborts_and_frees_blocks(loaded, engine):
    got_first = asyncio.Event()

    async def consume():
        async for _ in engine.generate("gone", ids(loaded, "Tell me a long story."),
                                       SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)):
            got_first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 60)
    assert engine.stats().num_running == 1 and engine.stats().kv_cache_usage > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0,
                what="the disconnected request to be aborted")
    assert engine.stats().generation_tokens_total < 500


async def test_consumer_that_stops_iterating_aborts(loaded, engine):
    gen = engine.generate("brk", ids(loaded, "Describe the ocean."),
                          SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    async for _ in gen:
        break
    await gen.aclose()
    await until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0,
                what="the abandoned request to be aborted")


async def test_abort_ends_the_stream_with_abort(loaded, engine):
    outs = []
    async for o in engine.generate("ab", ids(loaded, "Describe a forest."),
                                   SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)):
        outs.append(o)
        if len(outs) == 2:
            await engine.abort("ab")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs) < 50 and engine.stats().kv_cache_usage == 0.0


async def test_invalid_requests_fail_before_queueing(loaded, engine):
    with pytest.raises(ValueError):
        await collect(engine, "empty", [], SamplingParams())
    with pytest.raises(ValueError):
        await collect(engine, "long", [1] * (engine.max_model_len + 5), SamplingParams())
    assert engine.stats().num_waiting == 0


class FlakyStore:
    """A KV connector whose backing store is down for its first lookup."""

    def __init__(self) -> None:
        self.failures_left = 1

    def bind(self, kv_caches, block_size: int) -> None:
        pass

    def lookup(self, block_hashes) -> int:
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("kv store unreachable")
        return 0

    def load(self, block_hashes, block_ids) -> int:
        return 0

    def save(self, block_hashes, block_ids) -> None:
        pass


async def test_engine_error_fails_the_request_and_the_engine_recovers(loaded):
    eng = AsyncLLMEngine(EngineConfig(dtype="float32"), engine=build(loaded, FlakyStore()))
    await eng.start()
    try:
        prompt = ids(loaded, "A prompt long enough to have a full block of tokens in it, surely.")
        with pytest.raises(EngineError, match="kv store unreachable"):
            await asyncio.wait_for(collect(eng, "x", prompt, SamplingParams(max_tokens=4)), 60)
        assert eng.stats().kv_cache_usage == 0.0 and eng.stats().num_running == 0
        outs = await asyncio.wait_for(collect(eng, "y", prompt, SamplingParams(max_tokens=4)), 60)
        assert outs[-1].finished and outs[-1].num_output_tokens == 4
    finally:
        await eng.shutdown()
    assert not eng.is_running


async def test_an_idle_engine_faults_its_kv_cache_in_and_still_matches(loaded, engine):
    """Idle time goes to faulting the CPU KV cache in (kv_prefault.py); output unchanged."""
    p = engine.engine.runner.prefault
    total = sum(len(m) for m in p.maps)
    assert total > 16 << 20                          # the 32 MiB cache, in whole blocks
    await until(lambda: p.populated == total or p._i == len(p.maps), what="prefault done")
    prompt = ids(loaded, "What is rain?")
    offline = LLM(engine=build(loaded)).generate([prompt], SamplingParams(max_tokens=12))[0]
    got = await collect(engine, "r-idle", prompt, SamplingParams(max_tokens=12))
    assert [t for o in got for t in o.new_token_ids] == offline.token_ids
