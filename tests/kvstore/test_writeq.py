"""The store's write queue: bounded in blocks (queued + in flight), never waits on offer."""
import threading

from kvyard.kvstore.writeq import WriteQueue


def test_offer_takes_what_fits_and_counts_in_flight():
    q = WriteQueue(5)
    assert q.offer(list(range(3))) == 3
    assert q.offer(list(range(3, 8))) == 2  # 3 + 2 = capacity; the rest is the caller's to drop
    assert q.take(4) == [0, 1, 2, 3]
    assert q.offer([9]) == 0  # taken but not done still counts
    q.done(4)
    assert q.offer([9, 10]) == 2
    assert q.take(10) == [4, 9, 10]
    assert not q.join(0.01)  # three still in flight
    q.done(3)
    assert q.join(0.01)


def test_take_waits_for_items_and_close_ends_it():
    q = WriteQueue(8)
    got = []

    def taker():
        while (batch := q.take(2)) is not None:
            got.append(batch)
            q.done(len(batch))

    t = threading.Thread(target=taker)
    t.start()
    assert q.offer(["a", "b", "c"]) == 3
    assert q.join(10)  # the taker drained and acknowledged them
    q.close()
    t.join(10)
    assert not t.is_alive()
    assert [x for b in got for x in b] == ["a", "b", "c"] and all(len(b) <= 2 for b in got)
    assert q.offer(["d"]) == 0  # closed
