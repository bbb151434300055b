"""The same-host transfer (workers/pd/peer_shm.py, shm_pool.py): a puller gets exactly
the hold's frames, once, in a buffer of its own that it reuses per peer; a bad buffer
costs nobody the hold; a peer that breaks the contract (a corrupt frame, a lie about
progress, a cut connection, a try at shrinking the buffer) is refused, never loaded, and
its buffer is not reused.

Against the real prefill worker where the contract is kept; against small peers in this
process, on real abstract Unix sockets and real memfds, where it is broken on purpose.
"""
from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import uuid

import pytest

from kvyard.kvstore.codec import HEADER_BYTES, encode_header
from kvyard.kvstore.layout import KVLayout, Namespace
from kvyard.workers.kvconnector import model_identity_of
from kvyard.workers.pd import peer_shm
from kvyard.workers.pd.peer_shm import ShmUnavailable, pull_shm
from kvyard.workers.pd.peer_wire import PeerError
from kvyard.workers.pd.shm_pool import ShmPool

DEMO = KVLayout("float32", 16, 30, 3, 64)
SMALL = Namespace("test-model@0", KVLayout("float32", 16, 2, 1, 8))


def _pull(ktp: dict, ns: Namespace, pool: ShmPool, phases: dict | None = None) -> list:
    hashes = [int(h, 16) for h in ktp["kvyard"]["block_hashes"]]
    return asyncio.run(pull_shm(ktp["remote_engine_id"], ktp["remote_request_id"], ns, hashes,
                                30.0, pool, phases))


def test_a_pull_gets_exactly_the_hold_once_into_a_reused_buffer(pdh, prefill,
                                                                 wait_until) -> None:
    ns = Namespace(model_identity_of("demo"), DEMO)
    pool = ShmPool()
    ktp = pdh.leg(prefill, "Which island is the largest in the Mediterranean?")
    assert ktp["kvyard"]["shm"] is True and ktp["kvyard"]["kv_namespace"] == ns.digest.hex()
    phases: dict[str, float] = {}
    payloads = _pull(ktp, ns, pool, phases)
    n = len(ktp["remote_block_ids"])
    assert len(payloads) == n and all(p.nbytes == DEMO.nbytes for p in payloads)
    assert set(phases) == {"claim", "transfer", "verify"}
    view = payloads[0].obj                        # what the puller can see: the hold, no more
    assert all(p.obj is view for p in payloads)
    assert view.nbytes == n * (HEADER_BYTES + DEMO.nbytes)
    with pytest.raises(PeerError) as e:           # claimed once
        _pull(ktp, ns, pool)
    assert e.value.reason == "transfer_refused"
    # the first buffer is in use while its views live: the refused pull had a second
    # one, dropped after the refusal
    assert pool.created == 2 and pool.free_bytes == 0
    del payloads, view
    gc.collect()
    assert pool.free_bytes > 0                    # given back once the blocks are copied
    again = _pull(pdh.leg(prefill, "Which island is the largest in the Aegean?"), ns, pool)
    assert again and pool.created == 2            # the same buffer, no new memfd
    wait_until(lambda: pdh.kv_usage(prefill) == 0.0, timeout=30, what="the holds freed")


def _raw_request(ktp: dict, fds: list[int]) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(30)
        s.connect(peer_shm.socket_name(ktp["remote_engine_id"]))
        socket.send_fds(s, [peer_shm.packet({
            "remote_engine_id": ktp["remote_engine_id"],
            "remote_request_id": ktp["remote_request_id"],
            "num_blocks": len(ktp["remote_block_ids"])})], fds)
        return peer_shm.parse_packet(s.recv(1 << 16))


def test_a_bad_buffer_is_refused_and_costs_nobody_the_hold(pdh, prefill, wait_until) -> None:
    ktp = pdh.leg(prefill, "Which strait separates Europe from Africa?")
    small = os.memfd_create("small")
    os.ftruncate(small, 4096)
    r, w = os.pipe()
    try:
        for fds in ([], [small], [r]):            # none, too small, not a file
            answer = _raw_request(ktp, fds)
            assert answer["ok"] is False and answer["reason"] == "transfer_refused", answer
    finally:
        for fd in (small, r, w):
            os.close(fd)
    # the hold is still there for a proper pull
    ns = Namespace(model_identity_of("demo"), DEMO)
    assert len(_pull(ktp, ns, ShmPool())) == len(ktp["remote_block_ids"])
    wait_until(lambda: pdh.kv_usage(prefill) == 0.0, timeout=30, what="the hold freed")


def test_no_endpoint_means_tcp_and_nothing_is_contacted() -> None:
    pool = ShmPool()
    with pytest.raises(ShmUnavailable):                # nobody listens under that name
        asyncio.run(pull_shm(uuid.uuid4().hex, "r", SMALL, [1], 5.0, pool))
    with pytest.raises(ShmUnavailable):                # not a worker's id: never a name
        asyncio.run(pull_shm("../../x", "r", SMALL, [1], 5.0, pool))
    assert pool.created == 0


class FakePeer:
    """A same-host endpoint that answers one pull in `mode`'s way."""

    def __init__(self, mode: str, hashes: list[int]) -> None:
        self.engine_id = uuid.uuid4().hex
        self.mode, self.hashes = mode, hashes
        self.shrink_error: Exception | None = None
        self.sock = peer_shm.listen(self.engine_id)
        self.sock.setblocking(True)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            _, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
            lay, n = SMALL.layout, len(self.hashes)
            frames = bytearray()
            for i, h in enumerate(self.hashes):
                payload = bytes([i + 1]) * lay.nbytes
                frames += encode_header(SMALL.key(h), lay, payload) + payload
            if self.mode == "corrupt":
                frames[HEADER_BYTES + 5] ^= 0xFF
            try:
                conn.sendall(peer_shm.packet({"ok": True, "num_blocks": n,
                                              "block_bytes": lay.nbytes}))
                if self.mode == "cut":
                    return
                if self.mode == "shrink":
                    try:
                        os.ftruncate(fds[0], 0)
                    except OSError as e:
                        self.shrink_error = e
                if self.mode != "lie":
                    os.pwrite(fds[0], bytes(frames), 0)
                ready = n + 1 if self.mode == "overreport" else n
                conn.sendall(peer_shm.packet({"ready": ready, "done": True}))
                conn.recv(1)  # until the puller is done
            except OSError:   # the puller refused and went away: what these tests want
                pass
            finally:
                os.close(fds[0])

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


@pytest.mark.parametrize("mode,reason", [("corrupt", "transfer_corrupt"),
                                         ("lie", "transfer_corrupt"),
                                         ("overreport", "transfer_corrupt"),
                                         ("cut", "transfer_truncated")])
def test_a_peer_breaking_the_contract_is_refused(mode, reason) -> None:
    hashes = [11, 22, 33]
    peer = FakePeer(mode, hashes)
    pool = ShmPool()
    try:
        with pytest.raises(PeerError) as e:
            asyncio.run(pull_shm(peer.engine_id, "r", SMALL, hashes, 10.0, pool))
        assert e.value.reason == reason
        gc.collect()
        assert pool.created == 1 and pool.free_bytes == 0   # that buffer is never reused
    finally:
        peer.close()


def test_a_peer_keeping_the_contract_is_loaded_and_cannot_shrink_the_buffer() -> None:
    hashes = [11, 22, 33]
    peer = FakePeer("shrink", hashes)
    try:
        got = asyncio.run(pull_shm(peer.engine_id, "r", SMALL, hashes, 10.0, ShmPool()))
        assert [bytes(p[:1]) for p in got] == [b"\x01", b"\x02", b"\x03"]
        assert isinstance(peer.shrink_error, PermissionError)   # sealed: no SIGBUS here
    finally:
        peer.close()


def test_buffers_are_kept_per_peer_and_capped() -> None:
    pool = ShmPool(cap_bytes=64 << 20)
    a, va = pool.take("a", 1000)
    b, vb = pool.take("b", 1000)
    assert a.fd != b.fd and va.nbytes == vb.nbytes == 1000
    del va, vb
    gc.collect()
    a2, va2 = pool.take("a", 2000)
    assert a2 is a                                 # a's own buffer again, never b's
    b2, _ = pool.take("b", 64 << 20)               # too small: a new one, the old closed
    assert b2 is not b and b.closed
    del va2
    gc.collect()
    assert pool.free_bytes <= 64 << 20
    pool.close()
