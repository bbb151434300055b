"""Scheduler policy around connector loads: who waits, who goes, in what order, and
that a full cache of loaded-but-waiting requests never stalls the queue head.

The KV connector here holds block hashes only (the scheduler never sees bytes);
its loads run on the real `KVLoader` thread and can be held on an Event.
"""
from __future__ import annotations

import threading

from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.block_manager import BlockManager
from kvyard.workers.engine.kv_loads import KVLoader
from kvyard.workers.engine.scheduler import Scheduler
from kvyard.workers.engine.sequence import Sequence, SeqStatus

BS = 4


class HashConnector:
    """Has every block whose hash is in `have`; `gate` holds loads until set."""

    def __init__(self, have: set[int]) -> None:
        self.have = have
        self.gate = threading.Event()
        self.gate.set()
        self.loads: list[int] = []

    def lookup(self, block_hashes) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.have:
                break
            n += 1
        return n

    def load(self, block_hashes, block_ids) -> int:
        assert self.gate.wait(30)
        self.loads.append(len(block_ids))
        return len(block_ids)


def req(rid: str, n: int, base: int, arrival: float) -> Sequence:
    return Sequence(rid, [base + i for i in range(n)], n, SamplingParams(max_tokens=2),
                    arrival=arrival)


def hashes_of(seq: Sequence) -> set[int]:
    return set(seq.update_block_hashes(BS))


def make(num_blocks: int, conn: HashConnector, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, 64, conn, KVLoader(conn))


def settle(s: Scheduler) -> None:
    """Wait (on the loader's condition, not a clock) until every load has finished."""
    assert s.loader.wait_idle(30), "a load never finished"


def advance(s: Scheduler, out) -> None:
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        s.bm.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                s.finish(seq, "length")


def test_queue_goes_on_during_a_load_and_the_loaded_request_keeps_its_place():
    a, b, c = req("a", 21, 0, 1.0), req("b", 9, 500, 2.0), req("c", 9, 900, 3.0)
    conn = HashConnector(hashes_of(a))
    conn.gate.clear()
    s = make(64, conn, max_seqs=2)
    s.add(a)
    s.add(b)
    s.add(c)
    out = s.schedule()
    # a parks with its 5 loadable blocks; b goes meanwhile; c waits: a's load holds a slot
    assert a.status is SeqStatus.WAITING_FOR_KV_LOAD and len(a.block_table) == 5
    assert [x.request_id for x in out.seqs] == ["b"] and list(s.waiting) == [c]
    assert s.loads_in_flight == 1
    conn.gate.set()
    settle(s)
    advance(s, out)
    out = s.schedule()
    # a is back, ahead of c (who came after it), and admitted with its blocks as computed
    assert a.status is SeqStatus.RUNNING and a.num_cached_tokens == 20
    assert [x.request_id for x in out.seqs] == ["b", "a"] and out.num_new_tokens[1] == 1
    assert conn.loads == [5] and s.external_hit_tokens == 20


def test_loaded_requests_behind_the_head_give_their_blocks_back():
    """Two loads fill the cache; the head then needs one more block and nothing runs:
    the one behind it lets go of its loaded blocks (still cached) and the head starts."""
    a, b = req("a", 30, 0, 1.0), req("b", 13, 500, 2.0)
    conn = HashConnector(hashes_of(a) | hashes_of(b))
    s = make(10, conn)
    s.add(a)
    s.add(b)
    assert s.schedule().is_empty and s.blocked_on_loads is False  # both parked, queue empty
    assert len(a.block_table) == 7 and len(b.block_table) == 3 and s.bm.num_free_blocks == 0
    settle(s)
    out = s.schedule()
    assert [x.request_id for x in out.seqs] == ["a"] and not b.block_table
    assert b.status is SeqStatus.WAITING
    while True:
        advance(s, out)
        if not s.has_unfinished():
            break
        out = s.schedule()
        assert not out.is_empty
    assert conn.loads == [7, 3] and s.bm.num_free_blocks == 10


def test_abort_of_a_waiting_and_a_loading_request():
    a, a2 = req("a", 21, 0, 1.0), req("a2", 21, 0, 2.0)
    conn = HashConnector(hashes_of(a))
    conn.gate.clear()
    s = make(64, conn)
    s.add(a)
    s.add(a2)
    assert s.schedule().is_empty
    assert a2.status is SeqStatus.WAITING_FOR_KV_LOAD and not a2.block_table  # waits on a's
    s.abort("a2")
    s.abort("a")
    assert not s.has_unfinished() and s.loads_in_flight == 1
    assert s.bm.num_free_blocks == 64 - 5          # a's blocks: not while the load runs
    conn.gate.set()
    settle(s)
    assert s.schedule().is_empty and s.bm.num_free_blocks == 64 and s.loads_in_flight == 0
    assert len(s.bm.cached) == 5                    # what it read stays reusable
