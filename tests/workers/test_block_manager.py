"""Block manager invariants: no leaks, shared prefixes, LRU eviction, hit accounting, events."""
from __future__ import annotations

from kvyard.common.hashing import block_hashes
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.block_manager import BlockManager, KVEvent
from kvyard.workers.engine.sequence import Sequence

BS = 4


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams())


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """What the engine does after a step that ran all of `s`'s tokens."""
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_blocks(s)


def test_allocate_and_free_leave_no_block_behind():
    bm = BlockManager(10, BS)
    s = seq("a", list(range(10)))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    s.num_computed_tokens = 10
    assert bm.allocate(s, 2)          # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    assert bm.allocate(s, 3)          # 13 need a 4th
    assert len(s.block_table) == 4
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == [] and all(r == 0 for r in bm.ref_cnt)


def test_allocation_fails_without_side_effects_when_short():
    bm = BlockManager(3, BS)
    s = seq("a", list(range(20)))
    assert not bm.can_allocate(s, 20)
    assert not bm.allocate(s, 20)
    assert s.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate(s, 12) and not bm.can_append(_at(s, 12))


def _at(s: Sequence, computed: int) -> Sequence:
    s.num_computed_tokens = computed
    return s


def test_shared_prefix_is_reference_counted():
    bm = BlockManager(16, BS)
    a = seq("a", list(range(10)))
    compute_all(bm, a)
    b = seq("b", list(range(8)) + [99, 98, 97])
    hit = bm.match_prefix(b)
    assert hit == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens - 8, hit)
    assert b.num_computed_tokens == 8
    assert [bm.ref_cnt[x] for x in hit] == [2, 2]
    bm.free(a)
    assert [bm.ref_cnt[x] for x in hit] == [1, 1]
    assert all(x not in bm.free_queue for x in hit)      # still pinned by b
    bm.free(b)
    assert bm.num_free_blocks == 16
    assert bm.match_prefix(seq("c", list(range(9)))) == hit  # content survives the free


def test_prefix_match_leaves_one_token_to_compute():
    bm = BlockManager(8, BS)
    a = seq("a", list(range(8)))
    compute_all(bm, a)
    assert len(bm.cached) == 2
    # same 8 tokens: the second block is cached, but the last token must still run
    assert bm.match_prefix(seq("b", list(range(8)))) == a.block_table[:1]


def test_eviction_is_least_recently_used_and_reports_removals():
    bm = BlockManager(4, BS)
    events: list[KVEvent] = []
    bm.listeners.append(events.append)
    seqs = {k: seq(k, [ord(k)] * 5) for k in "abc"}   # one full block + 1 token each
    for k in "abc":                                   # a is used (and freed) first
        compute_all(bm, seqs[k])
        bm.free(seqs[k])
    full = {k: block_hashes(s.token_ids, BS)[0] for k, s in seqs.items()}
    # touch a again: it becomes the most recently used
    a2 = seq("a2", [ord("a")] * 5)
    hit = bm.match_prefix(a2)
    assert hit and bm.allocate(a2, 1, hit)
    bm.free(a2)
    events.clear()
    # uncached blocks go first, then b, then c; a survives longest
    taker = seq("x", [7] * 12)
    assert bm.allocate(taker, 12)
    removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
    assert removed == [full["b"], full["c"]]
    assert full["a"] in bm.cached and full["b"] not in bm.cached


def test_stored_events_chain_to_their_parent():
    bm = BlockManager(8, BS)
    events: list[KVEvent] = []
    bm.listeners.append(events.append)
    s = seq("a", list(range(6)))
    assert bm.allocate(s, 6)
    s.num_computed_tokens = 6
    bm.cache_blocks(s)
    s.token_ids += [6, 7, 8]
    assert bm.allocate(s, 3)
    s.num_computed_tokens = 9
    bm.cache_blocks(s)
    hashes = block_hashes(list(range(9)), BS)
    assert [(e.kind, e.block_hashes, e.parent_block_hash) for e in events] == [
        ("stored", hashes[:1], None), ("stored", hashes[1:2], hashes[0])]
    assert events[1].token_ids == [4, 5, 6, 7]


def test_duplicate_content_keeps_a_single_cache_entry():
    bm = BlockManager(8, BS)
    a, b = seq("a", list(range(5))), seq("b", list(range(5)))
    assert bm.allocate(a, 5) and bm.allocate(b, 5)   # both admitted before either finished
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_blocks(s)
    assert len(bm.cached) == 1 and bm.cached[block_hashes(list(range(5)), BS)[0]] == a.block_table[0]
    private = b.block_table[0]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert next(iter(bm.free_queue)) == private      # the uncached copy is reused first


def test_prefix_caching_off_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq("a", list(range(9)))
    compute_all(bm, a)
    assert bm.cached == {}
    assert bm.match_prefix(seq("b", list(range(9)))) == []


def test_usage_counts_only_pinned_blocks():
    bm = BlockManager(10, BS)
    a = seq("a", list(range(8)))
    compute_all(bm, a)
    assert abs(bm.usage - 0.2) < 1e-9
    bm.free(a)
    assert bm.usage == 0.0 and len(bm.cached) == 2
