"""kvstore loads off the engine thread, on the demo model and the real StoreConnector.

A request whose prefix the kvstore holds is parked (WAITING_FOR_KV_LOAD) while the
loader thread reads it; a load that blocks (a connector waiting on an Event the
test opens) never holds up the other streams' decode steps; an abort during the
load ends the request at once and frees its blocks when the load returns; a
partial, failed or shared load still gives the tokens computed without kvstore.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.kvstore import StoreConfig
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.llm import LLM
from kvyard.workers.engine.llm_engine import LLMEngine
from kvyard.workers.engine.sequence import SeqStatus
from kvyard.workers.kvconnector import StoreConnector

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
TEXT = ("You are a careful assistant who answers in one sentence and never repeats "
        "itself. " * 5 + "What is the tallest mountain in Europe, and how tall is it?")
IDENT = "SmolLM2-135M-Instruct@0123456789abcdef"


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32)
    return model, cfg, load_tokenizer("demo")


@pytest.fixture(scope="module")
def prompts(loaded) -> dict[str, list[int]]:
    tok = loaded[2]
    return {"p": tok.encode_chat([{"role": "user", "content": TEXT}]),
            "q": tok.encode_chat([{"role": "user", "content": "Count to twenty."}])}


def make(loaded, connector=None) -> LLMEngine:
    model, cfg, tok = loaded
    conf = EngineConfig(dtype="float32", kv_cache_memory_bytes=32 << 20, kv_connector=connector)
    return LLMEngine(conf, model, cfg, tok)


@pytest.fixture(scope="module")
def reference(loaded, prompts) -> dict[str, list[int]]:
    """Tokens without kvstore."""
    llm = LLM(engine=make(loaded))
    p, q = llm.generate([prompts["p"], prompts["q"]], [GREEDY, LONG])
    return {"p": p.token_ids, "q": q.token_ids}


@pytest.fixture(scope="module")
def store(loaded, prompts, reference):
    """A DRAM tier holding the prompt's full blocks, saved by an engine that computed them."""
    first = StoreConnector(StoreConfig(dram_bytes=1 << 26), IDENT)
    out = LLM(engine=make(loaded, first)).generate([prompts["p"]], GREEDY)[0]
    assert out.token_ids == reference["p"] and first.saved_blocks >= len(prompts["p"]) // 16
    yield first.store
    first.close()


class GatedConnector(StoreConnector):
    """The real connector; once `arm`ed, a load waits for the test to open `gate`.
    (Every chat prompt starts with the template's system text, so even a short one
    loads its first block: loads before `arm` pass.)"""

    def __init__(self, store) -> None:
        super().__init__(StoreConfig(dram_bytes=1 << 26), IDENT, store=store, pin_memory=False)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def arm(self) -> None:
        self.gate.clear()

    def load(self, block_hashes, block_ids) -> int:
        self.threads.append(threading.current_thread().name)
        if not self.gate.is_set():
            self.entered.set()
            if not self.gate.wait(60):
                raise TimeoutError("the test never opened the gate")
        return super().load(block_hashes, block_ids)


def full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // 16


def drive(eng: LLMEngine, toks: dict[str, list[int]], done: dict[str, object]) -> None:
    for o in eng.step():
        toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            done[o.request_id] = o


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-path", "cuda-staging-path"])
def test_slow_load_leaves_running_streams_decoding(loaded, prompts, reference, store, staged,
                                                   monkeypatch):
    # staged: the path CUDA caches take (kvconnector/staging.py), here on CPU caches
    monkeypatch.setattr(StoreConnector, "_force_staging", staged)
    conn = GatedConnector(store)
    eng = make(loaded, conn)
    toks: dict[str, list[int]] = {}
    done: dict[str, object] = {}
    eng.add_request("q", prompts["q"], LONG)
    while len(toks.get("q", [])) < 2:
        drive(eng, toks, done)
    conn.arm()
    eng.add_request("p", prompts["p"], GREEDY)
    drive(eng, toks, done)
    assert conn.entered.wait(30), "the kvstore hit was never loaded"
    assert eng.scheduler.requests["p"].status is SeqStatus.WAITING_FOR_KV_LOAD
    before = len(toks["q"])
    for _ in range(6):                  # the load is blocked all along: q gets a token a step
        drive(eng, toks, done)
    loaded_before = conn.loaded_blocks
    assert len(toks["q"]) == before + 6 and "p" not in toks
    assert eng.stats().num_waiting == 1 and eng.stats().num_running == 1
    conn.gate.set()
    while eng.has_unfinished_requests():
        drive(eng, toks, done)
    n = full_blocks(prompts["p"])
    assert toks["p"] == reference["p"] and toks["q"] == reference["q"]
    assert done["p"].num_cached_tokens == n * 16 and conn.loaded_blocks > loaded_before
    assert set(conn.threads) == {"kvyard-kv-load"}     # never the engine's own thread
    assert conn._staged is staged
    assert all(r == 0 for r in eng.block_manager.ref_cnt)


def test_abort_during_load_frees_the_blocks_when_it_returns(loaded, prompts, reference, store):
    conn = GatedConnector(store)
    eng = make(loaded, conn)
    woke = threading.Event()
    eng.set_kv_load_waker(woke.set)    # as the async engine does: steps never wait on loads
    conn.arm()
    eng.add_request("p", prompts["p"], GREEDY)
    assert eng.step() == [] and conn.entered.wait(30)
    n = full_blocks(prompts["p"])
    assert sum(1 for r in eng.block_manager.ref_cnt if r) == n
    out = eng.abort_request("p")
    assert out.finished and out.finish_reason == "abort"
    # the loader may still be writing those blocks: they stay referenced until it returns
    assert sum(1 for r in eng.block_manager.ref_cnt if r) == n
    assert eng.has_unfinished_requests() and not eng.has_schedulable_requests()
    conn.gate.set()
    assert woke.wait(30), "the loader never reported back"
    assert eng.has_schedulable_requests()
    assert eng.step() == []
    assert all(r == 0 for r in eng.block_manager.ref_cnt) and not eng.has_unfinished_requests()
    # what the aborted load read is in the prefix cache: a later request hits it locally
    eng.add_request("p2", prompts["p"], GREEDY)
    toks: dict[str, list[int]] = {}
    done: dict[str, object] = {}
    while eng.has_unfinished_requests():
        drive(eng, toks, done)
    assert toks["p2"] == reference["p"] and done["p2"].num_cached_tokens == n * 16
    assert conn.loaded_blocks == n


class PartialConnector(StoreConnector):
    """Loads everything, then scribbles over all but the first `keep` blocks and says
    only those arrived (a corrupt block further on); `fail`: scribbles over all, raises."""

    def __init__(self, store, keep: int = 0, fail: bool = False) -> None:
        super().__init__(StoreConfig(dram_bytes=1 << 26), IDENT, store=store)
        self.keep, self.fail = keep, fail

    def load(self, block_hashes, block_ids) -> int:
        super().load(block_hashes, block_ids)
        keep = 0 if self.fail else self.keep
        for kv in self._caches:
            kv[:, list(block_ids[keep:])] = torch.randn_like(kv[:, list(block_ids[keep:])])
        if self.fail:
            raise ConnectionError("the tier went away mid-read")
        return keep


@pytest.mark.parametrize("fail", [False, True], ids=["partial", "failed"])
def test_partial_or_failed_load_computes_the_rest(loaded, prompts, reference, store, fail):
    conn = PartialConnector(store, keep=2, fail=fail)
    eng = make(loaded, conn)
    out = LLM(engine=eng).generate([prompts["p"]], GREEDY)[0]
    assert out.token_ids == reference["p"]
    assert out.num_cached_tokens == (0 if fail else 2 * 16)
    assert eng.scheduler.kv_load_failures == int(fail)
    assert all(r == 0 for r in eng.block_manager.ref_cnt)


def test_requests_needing_the_same_blocks_share_one_load(loaded, prompts, reference, store):
    conn = StoreConnector(StoreConfig(dram_bytes=1 << 26), IDENT, store=store)
    eng = make(loaded, conn)
    outs = LLM(engine=eng).generate([prompts["p"], prompts["p"]], GREEDY)
    n = full_blocks(prompts["p"])
    assert [o.token_ids for o in outs] == [reference["p"]] * 2
    assert conn.loaded_blocks == n                      # read once, not once per request
    assert [o.num_cached_tokens for o in outs] == [n * 16] * 2
    assert eng.stats().prefix_hits_tokens == n * 16     # the second found them locally


async def test_async_engine_streams_while_a_load_blocks(loaded, prompts, reference, store):
    from kvyard.workers.engine.async_engine import AsyncLLMEngine

    conn = GatedConnector(store)
    eng = AsyncLLMEngine(EngineConfig(dtype="float32"), engine=make(loaded, conn))
    await eng.start()
    try:
        async def collect(rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
            return [t async for o in eng.generate(rid, prompt, params) for t in o.new_token_ids]

        q_toks: list[int] = []
        q_stream = eng.generate("q", prompts["q"], LONG)
        async for o in q_stream:
            q_toks += o.new_token_ids
            if len(q_toks) == 2:
                break
        conn.arm()
        p_task = asyncio.ensure_future(collect("p", prompts["p"], GREEDY))
        assert await asyncio.to_thread(conn.entered.wait, 30)
        async for o in q_stream:        # the load is blocked: q keeps streaming regardless
            q_toks += o.new_token_ids
            if len(q_toks) == 12:
                break
        assert not p_task.done() and not conn.gate.is_set()
        conn.gate.set()
        async for o in q_stream:
            q_toks += o.new_token_ids
        assert q_toks == reference["q"]
        assert await asyncio.wait_for(p_task, 120) == reference["p"]
        assert eng.stats().kv_cache_usage == 0.0
    finally:
        await eng.shutdown()
