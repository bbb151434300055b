"""The engine's P/D seams on the demo model: a prefill engine holds its prompt blocks,
a decode engine parks a request, loads those blocks as prefix-cache entries and
produces the tokens it would have produced prefilling itself; holds expire."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvyard.common.models import resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers.engine.api import RemoteKV, SamplingParams
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.kv_blocks import gather, layout_of
from kvyard.workers.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = ("You are a careful assistant. Answer in one sentence. " * 6
          + "What is the capital of France, and why is it famous?")


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32)
    return model, cfg, load_tokenizer("demo")


def make(loaded, **kw) -> LLMEngine:
    model, cfg, tok = loaded
    conf = EngineConfig(dtype="float32", kv_cache_memory_bytes=64 << 20, **kw)
    return LLMEngine(conf, model, cfg, tok)


def run(eng: LLMEngine, rid: str) -> tuple[list[int], list]:
    toks, outs = [], []
    while eng.has_schedulable_requests():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                outs.append(o)
    return toks, outs


@pytest.fixture(scope="module")
def prompt(loaded) -> list[int]:
    return loaded[2].encode_chat([{"role": "user", "content": PROMPT}])


def test_parked_request_decodes_from_remote_blocks_token_for_token(loaded, prompt):
    ref = make(loaded)
    ref.add_request("r", prompt, GREEDY)
    want, _ = run(ref, "r")

    pre = make(loaded)
    pre.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    _, outs = run(pre, "p")
    hold = outs[-1].kv_hold
    assert hold is not None and len(hold.block_ids) == len(prompt) // 16
    held = set(hold.block_ids)
    assert all(pre.block_manager.ref_cnt[b] == 1 for b in held)  # pinned while held
    lay = layout_of(pre.runner.kv_caches)
    buf = np.empty((len(hold.block_ids), lay.nbytes), dtype=np.uint8)
    gather(pre.runner.kv_caches, hold.block_ids, buf)

    dec = make(loaded)
    dec.add_request("d", prompt, GREEDY, parked=True)
    assert not dec.has_schedulable_requests() and dec.step() == []  # parked: nothing to run
    assert dec.stats().num_waiting == 1
    got_blocks = dec.load_remote_kv("d", RemoteKV(hold.block_hashes, list(buf)))
    assert got_blocks == min(len(hold.block_ids), (len(prompt) - 1) // 16)
    got, outs = run(dec, "d")
    assert got == want
    assert outs[-1].num_cached_tokens == got_blocks * 16   # admitted as prefix-cache hits
    assert all(r == 0 for r in dec.block_manager.ref_cnt)   # pins released with the request

    pre.handoff.holds.finish("p")
    assert pre.handoff.reap() == len(held)
    assert all(pre.block_manager.ref_cnt[b] == 0 for b in held)


def test_unmatched_or_missing_remote_blocks_prefill_locally(loaded, prompt):
    ref = make(loaded)
    ref.add_request("r", prompt, GREEDY)
    want, _ = run(ref, "r")
    dec = make(loaded)
    dec.add_request("a", prompt, GREEDY, parked=True)
    lay = layout_of(dec.runner.kv_caches)
    junk = [np.zeros(lay.nbytes, dtype=np.uint8)] * 3
    assert dec.load_remote_kv("a", RemoteKV([1, 2, 3], junk)) == 0  # other hashes: ignored
    assert run(dec, "a")[0] == want
    dec2 = make(loaded)
    dec2.add_request("b", prompt, GREEDY, parked=True)
    assert dec2.load_remote_kv("b", None) == 0
    assert run(dec2, "b")[0] == want


def test_a_failed_remote_load_leaves_nothing_pinned_or_cached_and_prefills(loaded, prompt):
    """handoff.load_remote: blocks whose write failed leave the prefix cache, every pin
    goes back, and the request queues anyway (it prefills itself)."""
    ref = make(loaded)
    ref.add_request("r", prompt, GREEDY)
    want, _ = run(ref, "r")
    dec = make(loaded)
    dec.add_request("d", prompt, GREEDY, parked=True)
    seq = dec.scheduler.parked["d"]
    own = seq.update_block_hashes(16)
    short = [np.zeros(3, dtype=np.uint8)] * 2   # payloads of the wrong size: the write fails
    with pytest.raises(Exception):
        dec.load_remote_kv("d", RemoteKV(own[:2], short))
    assert "d" not in dec.scheduler.parked and seq.pinned_blocks == []
    assert all(r == 0 for r in dec.block_manager.ref_cnt)
    assert dec.block_manager.match_prefix(seq) == []         # nothing cached under its hashes
    assert run(dec, "d")[0] == want


def test_unpulled_hold_is_freed_after_its_ttl(loaded, prompt):
    pre = make(loaded, kv_hold_ttl_s=5.0)
    pre.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    hold = run(pre, "p")[1][-1].kv_hold
    assert pre.handoff.reap() == 0
    assert pre.handoff.holds.reap(now=hold.deadline + 1) == [hold.block_ids]
    assert pre.handoff.holds.claim("p") is None
    # a claimed hold survives its deadline until the transfer says it is done
    pre.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    hold = run(pre, "q")[1][-1].kv_hold
    assert pre.handoff.holds.claim("q") is hold and pre.handoff.holds.claim("q") is None
    assert pre.handoff.holds.reap(now=hold.deadline + 1) == []
    pre.handoff.holds.finish("q")
    assert pre.handoff.holds.reap() == [hold.block_ids]


def test_aborted_hold_request_and_parked_request_free_everything(loaded, prompt):
    eng = make(loaded)
    eng.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    eng.add_request("d", prompt, GREEDY, parked=True)
    eng.abort_request("p")
    eng.abort_request("d")
    assert not eng.has_unfinished_requests() and len(eng.handoff.holds) == 0
    assert all(r == 0 for r in eng.block_manager.ref_cnt)


async def test_parked_request_never_stalls_the_step_loop(loaded, prompt) -> None:
    """While one request waits for its remote KV (a future nobody resolves yet), the
    engine thread serves another from start to finish; then the parked one runs."""
    import asyncio

    from kvyard.workers.engine.async_engine import AsyncLLMEngine

    ref = make(loaded)
    ref.add_request("r", prompt, GREEDY)
    want, _ = run(ref, "r")
    eng = AsyncLLMEngine(EngineConfig(dtype="float32"), engine=make(loaded))
    await eng.start()
    try:
        arrived: asyncio.Future = asyncio.get_running_loop().create_future()

        async def parked() -> list[int]:
            out: list[int] = []
            async for o in eng.generate("parked", prompt, GREEDY, remote_kv=arrived):
                out += o.new_token_ids
            return out
        task = asyncio.ensure_future(parked())
        other = [t for o in [o async for o in eng.generate(
            "other", loaded[2].encode_chat([{"role": "user", "content": "Hi"}]),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))]
            for t in o.new_token_ids]
        assert len(other) == 5 and not task.done()
        assert eng.stats().num_waiting == 1            # the parked one, still waiting
        arrived.set_result(None)                       # nothing came: it prefills itself
        assert await asyncio.wait_for(task, 120) == want
    finally:
        await eng.shutdown()


def test_a_hold_grows_chunk_by_chunk_and_outlives_preemption_of_its_request(loaded, prompt):
    """Chunked prefill: after each step the hold has the blocks computed so far, each
    referenced by the hold itself (a preemption frees the request's blocks, not those),
    and holding the bytes an unchunked prefill computes; the request's end completes it."""
    ref = make(loaded)
    ref.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    want = run(ref, "r")[1][-1].kv_hold
    lay = layout_of(ref.runner.kv_caches)
    want_bytes = np.empty((len(want.block_ids), lay.nbytes), dtype=np.uint8)
    gather(ref.runner.kv_caches, want.block_ids, want_bytes)

    eng = make(loaded, max_num_batched_tokens=32)
    eng.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True,
                    hold_id="ab" * 16)
    seq = eng.scheduler.requests["p"]
    hold = seq.kv_hold
    assert hold.request_id == "ab" * 16 and hold.growing and hold.block_ids == []
    assert eng.handoff.holds.claim("ab" * 16) is hold
    sizes = []
    eng.step()
    eng.step()
    assert len(hold.block_ids) == 4 and hold.growing     # 64 tokens computed: 4 blocks
    assert eng.handoff.holds.wait(hold, 3, 0.0) == (4, True)
    with pytest.raises(TimeoutError):
        eng.handoff.holds.wait(hold, 4, 0.01)                 # nothing new until the next step
    assert all(eng.block_manager.ref_cnt[b] == 2 for b in hold.block_ids)  # request + hold
    first = list(hold.block_ids)
    eng.scheduler._preempt(seq)                          # as when blocks run out
    assert seq.block_table == [] and all(eng.block_manager.ref_cnt[b] == 1 for b in first)
    while eng.has_schedulable_requests():
        eng.step()
        sizes.append(len(hold.block_ids))
    assert not hold.growing and hold.deadline < float("inf")
    assert hold.block_ids[:4] == first and sizes == sorted(sizes) and sizes[0] > 4
    assert len(hold.block_ids) == len(prompt) // 16 and hold.block_hashes == want.block_hashes
    got = np.empty_like(want_bytes)
    gather(eng.runner.kv_caches, hold.block_ids, got)
    np.testing.assert_allclose(got.view(np.float32), want_bytes.view(np.float32), rtol=1e-4,
                               atol=1e-5)
    assert all(eng.block_manager.ref_cnt[b] == 1 for b in hold.block_ids)  # the hold's only
    eng.handoff.holds.finish(hold.request_id)
    assert eng.handoff.reap() == len(hold.block_ids)
    assert all(r == 0 for r in eng.block_manager.ref_cnt)


def test_a_hold_whose_request_is_aborted_fails_its_pull(loaded, prompt):
    eng = make(loaded, max_num_batched_tokens=32)
    eng.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    hold = eng.handoff.holds.claim("p")
    eng.step()
    assert len(hold.block_ids) == 2
    eng.abort_request("p")
    with pytest.raises(RuntimeError):
        eng.handoff.holds.wait(hold, 2, 1.0)
    assert eng.block_manager.ref_cnt[hold.block_ids[0]] == 1   # claimed: kept while read
    eng.handoff.holds.finish("p")
    eng.handoff.reap()
    assert all(r == 0 for r in eng.block_manager.ref_cnt) and len(eng.handoff.holds) == 0
    # an unclaimed one goes back at once
    eng.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    eng.step()
    eng.abort_request("q")
    assert all(r == 0 for r in eng.block_manager.ref_cnt) and len(eng.handoff.holds) == 0
