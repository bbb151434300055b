"""The prefill worker's holds: blocks kept for a pull are counted while held
(`kvyard:pd_held_blocks`) and by how each hold ended (`kvyard:pd_holds_total{outcome}`):
pulled in full, expired unpulled, aborted when the puller went away mid-transfer;
in every case the blocks go back."""
from __future__ import annotations

import json
import socket
import struct

from kvyard.common import wire
from kvyard.workers.pd.peer_wire import HEAD_BYTES, message


def _holds(pdh, w, outcome: str) -> float:
    return pdh.counter(w, wire.M_PD_HOLDS, outcome=outcome)


def _held(pdh, w) -> float:
    return pdh.counter(w, wire.M_PD_HELD_BLOCKS)


def test_unpulled_blocks_are_freed_after_the_hold_timeout(pdh, prefill, wait_until) -> None:
    wait_until(lambda: _held(pdh, prefill) == 0, timeout=60, what="no hold left over")
    expired = _holds(pdh, prefill, "expired")
    ktp = pdh.leg(prefill, "Count the bridges of Paris.")
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    assert ktp["remote_block_ids"] and ktp["tp_size"] == 1
    assert {"remote_engine_id", "remote_request_id", "remote_host", "remote_port"} <= set(ktp)
    assert len(ktp["kvyard"]["block_hashes"]) == len(ktp["remote_block_ids"])
    assert ktp["kvyard"]["shm"] is True          # a same-host endpoint serves it too
    assert pdh.kv_usage(prefill) > 0.0            # held for a pull that never comes
    assert _held(pdh, prefill) == len(ktp["remote_block_ids"])
    wait_until(lambda: pdh.kv_usage(prefill) == 0.0, timeout=120, what="the hold's timeout")
    assert _held(pdh, prefill) == 0
    assert _holds(pdh, prefill, "expired") == expired + 1


def test_a_pulled_hold_is_counted_and_freed(pdh, prefill, decode, key_file, wait_until) -> None:
    pulled = _holds(pdh, prefill, "pulled")
    user = "Which bridges cross the Seine?"
    want = pdh.reference(prefill, user)
    status, got = pdh.post(decode.base_url, pdh.body(user),
                           pdh.signed(key_file, pdh.prefill_address(prefill)))
    assert status == 200 and pdh.text_of(got) == pdh.text_of(want)
    wait_until(lambda: _holds(pdh, prefill, "pulled") == pulled + 1, timeout=30,
               what="the pull counted")
    wait_until(lambda: _held(pdh, prefill) == 0, timeout=30, what="held blocks freed")


def test_a_pull_cut_short_is_an_aborted_hold(pdh, prefill, wait_until) -> None:
    """A puller that reads the ok and goes away: the hold (~1,400 tokens, far more than
    the sockets buffer) is aborted, and its blocks go back at once, not at the timeout."""
    wait_until(lambda: _held(pdh, prefill) == 0, timeout=60, what="no hold left over")
    aborted = _holds(pdh, prefill, "aborted")
    ktp = pdh.leg(prefill, "Go on: " + "river bridge city " * 460)
    n = len(ktp["remote_block_ids"])
    assert n > 80 and _held(pdh, prefill) == n
    with socket.create_connection((ktp["remote_host"], ktp["remote_port"]), timeout=30) as c:
        c.sendall(message({"remote_engine_id": ktp["remote_engine_id"],
                           "remote_request_id": ktp["remote_request_id"], "num_blocks": n}))
        head = _recv_exactly(c, HEAD_BYTES)
        assert json.loads(_recv_exactly(c, int.from_bytes(head[4:8], "little")))["ok"] is True
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
    wait_until(lambda: _holds(pdh, prefill, "aborted") == aborted + 1, timeout=30,
               what="the cut-short pull counted")
    # a claimed hold never expires: only the abort's end gives its blocks back
    wait_until(lambda: _held(pdh, prefill) == 0, timeout=30, what="blocks freed")


def _recv_exactly(c: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        assert chunk, "the prefill worker closed early"
        out += chunk
    return out
