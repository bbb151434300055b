"""Scheduler policy: token budget, decodes first, FCFS, preemption/resume, cancellation.

The model is replaced by the engine's own bookkeeping (advance computed
tokens, cache full blocks, append a token for sequences that sample), which
is all the scheduler can observe. Chunked-vs-unchunked equality on the real
model lives in test_engine.py.
"""
from __future__ import annotations

from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.block_manager import BlockManager
from kvyard.workers.engine.scheduler import Scheduler, SchedulerOutput
from kvyard.workers.engine.sequence import Sequence, SeqStatus

BS = 4


def make(num_blocks=64, max_seqs=8, budget=32, caching=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, caching), max_seqs, budget)


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0) -> Sequence:
    return Sequence(rid, [base + i for i in range(n)], n, SamplingParams(max_tokens=max_tokens))


def advance(s: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """The engine's post-step bookkeeping; finished sequences are retired."""
    sampled = []
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        s.bm.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1000 + seq.num_output_tokens)
            sampled.append(seq)
    for seq in sampled:
        if seq.num_output_tokens >= seq.params.max_tokens:
            s.finish(seq, "length")
    return sampled


def drain(s: Scheduler, limit: int = 500) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished():
        out = s.schedule()
        assert not out.is_empty, "scheduler stalled with work left"
        advance(s, out)
        outs.append(out)
        assert len(outs) < limit
    return outs


def test_token_budget_and_seq_limit_hold_every_step():
    s = make(budget=16, max_seqs=3)
    for i in range(6):
        s.add(req(f"r{i}", 13 + i, max_tokens=5, base=100 * i))
    for out in drain(s):
        assert out.num_tokens <= 16
        assert len(out.seqs) <= 3
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_decodes_come_first_and_prefills_are_chunked():
    s = make(budget=10)
    a = req("a", 3, max_tokens=10)
    s.add(a)
    advance(s, s.schedule())                      # a: whole prompt, first token
    s.add(req("b", 25, base=50))
    out = s.schedule()
    assert out.seqs[0] is a and out.num_new_tokens[0] == 1 and out.num_decodes == 1
    assert out.seqs[1].request_id == "b" and out.num_new_tokens[1] == 9   # chunk = what is left
    advance(s, out)
    out = s.schedule()
    assert [x.request_id for x in out.seqs] == ["a", "b"] and out.num_new_tokens == [1, 9]


def test_admission_is_first_come_first_served():
    s = make(num_blocks=6, budget=64)
    s.add(req("big", 20, base=0))                 # 5 blocks
    s.add(req("huge", 12, base=100))              # 3 blocks: does not fit next to big
    s.add(req("tiny", 2, base=200))               # would fit, but must not overtake
    out = s.schedule()
    assert [x.request_id for x in out.seqs] == ["big"]
    assert [x.request_id for x in s.waiting] == ["huge", "tiny"]


def test_preemption_recomputes_newest_and_frees_its_blocks():
    s = make(num_blocks=5, budget=64)
    old, new = req("old", 7, max_tokens=8), req("new", 7, max_tokens=8, base=100)
    s.add(old)
    s.add(new)
    advance(s, s.schedule())                      # both prefilled: 2 blocks each, 1 free
    preempted = None
    for _ in range(8):
        out = s.schedule()
        if out.preempted:
            preempted = out
            break
        advance(s, out)
    assert preempted is not None and preempted.preempted == [new]
    assert new.status is SeqStatus.WAITING and new.block_table == [] and s.waiting[0] is new
    assert old in preempted.seqs and new not in preempted.seqs
    assert s.num_preemptions == 1
    advance(s, preempted)
    produced_before = new.num_output_tokens
    drain(s)
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8 and produced_before > 0
    assert s.bm.num_free_blocks == 5 and all(r == 0 for r in s.bm.ref_cnt)


def test_resumed_sequence_reuses_its_cached_blocks():
    s = make(num_blocks=5, budget=64)
    s.add(req("old", 7, max_tokens=8))
    new = req("new", 7, max_tokens=8, base=100)
    s.add(new)
    resumes = []                                  # (tokens already computed, tokens scheduled)
    for _ in range(100):
        if not s.has_unfinished():
            break
        out = s.schedule()
        for q, n in zip(out.seqs, out.num_new_tokens):
            if q is new and q.num_preemptions and n > 1:
                resumes.append((q.num_computed_tokens, n, q.num_tokens))
        advance(s, out)
    assert new.num_preemptions == 1 and len(resumes) == 1
    computed, n, total = resumes[0]
    # the recompute skipped the full blocks that survived in the prefix cache
    assert computed >= BS and computed + n == total
    assert new.num_output_tokens == 8 and s.bm.num_free_blocks == 5


def test_abort_frees_blocks_immediately():
    s = make(num_blocks=16)
    a, b = req("a", 9), req("b", 9, base=50)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    assert s.bm.num_free_blocks == 16 - 6
    assert s.abort("a") is a
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "abort"
    assert s.bm.num_free_blocks == 16 - 3 and a not in s.running
    s.add(req("c", 3, base=90))
    assert s.abort("c").finish_reason == "abort" and not s.waiting
    assert s.abort("nope") is None
    drain(s)
    assert s.bm.num_free_blocks == 16


def test_prefix_hits_are_counted_in_tokens():
    s = make()
    s.add(req("a", 10))
    drain(s)
    s.add(req("b", 10))
    out = s.schedule()
    assert out.num_new_tokens == [2]              # 8 tokens (2 blocks) came from the cache
    assert s.bm.prefix_queries_tokens == 20 and s.bm.prefix_hits_tokens == 8
    assert out.seqs[0].num_cached_tokens == 8
