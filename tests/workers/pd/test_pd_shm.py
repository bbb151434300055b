"""The same-host transfer (workers/pd/peer_shm.py): what a puller gets is a sealed memfd
holding exactly the hold's frames, once; and a peer that breaks the contract (no size
seals, no write seal, a corrupt frame, a connection cut short) is refused, never loaded.

Against the real prefill worker where the contract is kept; against small peers in this
process, on real abstract Unix sockets and real memfds, where it is broken on purpose.
"""
from __future__ import annotations

import asyncio
import fcntl
import mmap
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

DEMO = KVLayout("float32", 16, 30, 3, 64)
SMALL = Namespace("test-model@0", KVLayout("float32", 16, 2, 1, 8))


def test_a_pull_gets_exactly_the_hold_sealed_and_only_once(pdh, prefill, wait_until) -> None:
    ns = Namespace(model_identity_of("demo"), DEMO)
    ktp = pdh.leg(prefill, "Which island is the largest in the Mediterranean?")
    assert ktp["kvyard"]["shm"] is True and ktp["kvyard"]["kv_namespace"] == ns.digest.hex()
    hashes = [int(h, 16) for h in ktp["kvyard"]["block_hashes"]]
    eid, rid = ktp["remote_engine_id"], ktp["remote_request_id"]
    phases: dict[str, float] = {}
    payloads = asyncio.run(pull_shm(eid, rid, ns, hashes, 30.0, phases))
    assert len(payloads) == len(hashes) and all(p.nbytes == DEMO.nbytes for p in payloads)
    assert set(phases) == {"claim", "transfer", "verify"}
    # the mapping is exactly the hold's frames: nothing of the rest of the cache
    mapped = payloads[0].obj                       # the array over the whole mapping
    assert all(p.obj is mapped for p in payloads)
    assert mapped.nbytes == len(hashes) * (HEADER_BYTES + DEMO.nbytes)
    del payloads, mapped
    with pytest.raises(PeerError) as e:             # claimed once
        asyncio.run(pull_shm(eid, rid, ns, hashes, 30.0))
    assert e.value.reason == "transfer_refused"
    wait_until(lambda: pdh.kv_usage(prefill) == 0.0, timeout=30, what="the hold freed")


def test_the_descriptor_is_sealed_against_writes_and_resizing(pdh, prefill) -> None:
    ktp = pdh.leg(prefill, "Which strait separates Europe from Africa?")
    n = len(ktp["remote_block_ids"])
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(30)
        s.connect(peer_shm.socket_name(ktp["remote_engine_id"]))
        s.sendall(peer_shm.packet({"remote_engine_id": ktp["remote_engine_id"],
                                   "remote_request_id": ktp["remote_request_id"],
                                   "num_blocks": n}))
        data, fds, _, _ = socket.recv_fds(s, 1 << 16, 1)
        assert peer_shm.parse_packet(data)["ok"] is True and len(fds) == 1
        fd = fds[0]
        try:
            while not peer_shm.parse_packet(s.recv(1 << 16)).get("sealed"):
                pass
            assert os.fstat(fd).st_size == n * (HEADER_BYTES + DEMO.nbytes)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            for seal in (fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_WRITE,
                         fcntl.F_SEAL_SEAL):
                assert seals & seal
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        finally:
            os.close(fd)


def test_no_endpoint_means_tcp_and_nothing_is_contacted() -> None:
    with pytest.raises(ShmUnavailable):                # nobody listens under that name
        asyncio.run(pull_shm(uuid.uuid4().hex, "r", SMALL, [1], 5.0))
    with pytest.raises(ShmUnavailable):                # not a worker's id: never a name
        asyncio.run(pull_shm("../../x", "r", SMALL, [1], 5.0))


class FakePeer:
    """A same-host endpoint that answers one pull with `mode`'s kind of memfd."""

    def __init__(self, mode: str, hashes: list[int]) -> None:
        self.engine_id = uuid.uuid4().hex
        self.mode, self.hashes = mode, hashes
        self.sock = peer_shm.listen(self.engine_id)
        self.sock.setblocking(True)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(1 << 16)
            lay = SMALL.layout
            frames = bytearray()
            for i, h in enumerate(self.hashes):
                payload = bytes([i + 1]) * lay.nbytes
                frames += encode_header(SMALL.key(h), lay, payload) + payload
            if self.mode == "corrupt":
                frames[HEADER_BYTES + 5] ^= 0xFF
            fd = os.memfd_create("fake", os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, len(frames))
                if self.mode != "unsized":
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                socket.send_fds(conn, [peer_shm.packet({"ok": True, "num_blocks": len(
                    self.hashes), "block_bytes": lay.nbytes})], [fd])
                if self.mode == "cut":
                    return
                os.pwrite(fd, bytes(frames), 0)
                if self.mode != "unsealed":
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
                conn.sendall(peer_shm.packet({"ready": len(self.hashes), "sealed": True}))
                conn.recv(1)  # until the puller is done
            except OSError:   # the puller refused and went away: what these tests want
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


@pytest.mark.parametrize("mode,reason", [("unsized", "transfer_corrupt"),
                                         ("unsealed", "transfer_corrupt"),
                                         ("corrupt", "transfer_corrupt"),
                                         ("cut", "transfer_truncated")])
def test_a_peer_breaking_the_contract_is_refused(mode, reason) -> None:
    hashes = [11, 22, 33]
    peer = FakePeer(mode, hashes)
    try:
        with pytest.raises(PeerError) as e:
            asyncio.run(pull_shm(peer.engine_id, "r", SMALL, hashes, 10.0))
        assert e.value.reason == reason
    finally:
        peer.close()


def test_a_peer_keeping_the_contract_is_loaded() -> None:
    hashes = [11, 22, 33]
    peer = FakePeer("good", hashes)
    try:
        got = asyncio.run(pull_shm(peer.engine_id, "r", SMALL, hashes, 10.0))
        assert [bytes(p[:1]) for p in got] == [b"\x01", b"\x02", b"\x03"]
    finally:
        peer.close()
