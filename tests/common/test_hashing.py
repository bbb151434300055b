"""Chained block hashes: the KV-block key shared by the engine, kvstore and EPP."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvyard.common.hashing import NONE_HASH, block_hashes, seed_for

BS = 16


@pytest.fixture()
def ids() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(0, 150_000) for _ in range(10 * BS + 5)]


def test_only_full_blocks_are_hashed(ids):
    assert len(block_hashes(ids, BS)) == 10
    assert block_hashes(ids[:BS - 1], BS) == []
    assert len(set(block_hashes(ids, BS))) == 10


def test_equal_prefixes_give_equal_hashes(ids):
    other = ids[:4 * BS] + [1] * (3 * BS)
    a, b = block_hashes(ids, BS), block_hashes(other, BS)
    assert a[:4] == b[:4]
    assert all(x != y for x, y in zip(a[4:], b[4:]))


def test_changing_an_early_block_changes_every_later_hash(ids):
    changed = list(ids)
    changed[BS + 3] += 1  # inside block 1
    a, b = block_hashes(ids, BS), block_hashes(changed, BS)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


def test_same_block_at_another_position_hashes_differently(ids):
    block = ids[:BS]
    assert block_hashes(block * 2, BS)[0] != block_hashes(block * 2, BS)[1]


def test_incremental_equals_full(ids):
    full = block_hashes(ids, BS)
    head = block_hashes(ids[:4 * BS + 2], BS)
    tail = block_hashes(ids, BS, parent=head[-1], start_block=len(head))
    assert head + tail == full
    assert block_hashes(ids, BS, parent=NONE_HASH, start_block=0) == full


def test_seed_separates_hash_spaces(ids):
    a = block_hashes(ids, BS, seed=seed_for("model-a"))
    b = block_hashes(ids, BS, seed=seed_for("model-b"))
    assert a != block_hashes(ids, BS) and a != b
    assert seed_for("model-a") == seed_for("model-a")


def test_numpy_and_list_inputs_agree(ids):
    assert block_hashes(np.array(ids, dtype=np.int64), BS) == block_hashes(ids, BS)
    assert block_hashes(np.array(ids, dtype=np.uint32), BS) == block_hashes(ids, BS)


def test_rejects_bad_block_size(ids):
    with pytest.raises(ValueError):
        block_hashes(ids, 0)
