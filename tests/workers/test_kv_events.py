"""KV-cache events as vLLM publishes them (--kv-events-config): the config's validation,
the publisher over real ZMQ sockets (batches in sequence, replay, overflow turned into
AllBlocksCleared), and a real demo worker whose events describe exactly the blocks it
cached, evicted and cleared."""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvyard.common import kv_events as kve
from kvyard.common.hashing import block_hashes
from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.workers.engine.block_manager import KVEvent
from kvyard.workers.server.cli import add_arguments
from kvyard.workers.server.kv_events import KVEventMetrics, KVEventPublisher
from kvyard.workers.server.testing import free_port, start_worker


def _config(**kw) -> kve.KVEventsConfig:
    return kve.KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **kw)


def test_config_is_validated_as_vllm_would() -> None:
    cfg = kve.KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                   '"endpoint": "tcp://*:5557", "topic": "kv@pod@m"}')
    assert cfg.active and cfg.topic == "kv@pod@m" and cfg.buffer_steps == 10_000
    assert not kve.KVEventsConfig.parse('{"enable_kv_cache_events": false, '
                                        '"publisher": "zmq"}').active
    for bad, what in (('{"publisher": "kafka"}', "publisher"), ('{"hwm": 0}', "hwm"),
                      ('{"endpoint": 5}', "endpoint"), ('{"bogus": 1}', "bogus"),
                      ("[]", "object"), ("{", "JSON")):
        with pytest.raises(ValueError, match=what):
            kve.KVEventsConfig.parse(bad)
    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    with pytest.raises(argparse.ArgumentError, match="unknown field"):
        p.parse_args(["--kv-events-config", '{"enable": true}'])


class _Sub:
    """The test's subscriber: binds (the publisher connects, as to a collector) and reads."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def recv(self, timeout_s: float = 30.0) -> tuple[bytes, int, list[dict]]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no KV-event batch arrived")
        topic, seq, payload = self.sock.recv_multipart()
        return topic, int.from_bytes(seq, "big"), kve.decode_batch(payload)[1]

    def close(self) -> None:
        self.sock.close(linger=0)


def _replay(endpoint: str, start: int, topic: bytes | None = None) -> list[tuple[int, list[dict]]]:
    """The replayed batches; vLLM >= 0.26's frames (b"", topic, seq, payload)."""
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.connect(endpoint)
    try:
        d.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert d.poll(30_000), "the replay did not answer"
            frames = d.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if topic is not None:
                assert frames[1] == topic
            _, _, seq, payload = frames
            assert kve.replay_reply(frames)[1] == payload
            if seq == kve.END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), kve.decode_batch(payload)[1]))
    finally:
        d.close(linger=0)


def _joined(sub: _Sub, pub: KVEventPublisher) -> int:
    """Publish probes until one arrives (a ZMQ subscription takes a moment to reach the
    publisher); returns the next sequence number."""
    deadline = time.monotonic() + 30
    while True:
        pub.on_event(KVEvent("all_cleared", []))
        try:
            _, seq, _ = sub.recv(0.2)
            while sub.sock.poll(100):          # probes already on their way
                seq = int.from_bytes(sub.sock.recv_multipart()[1], "big")
            return seq + 1
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def test_publisher_sends_batches_in_sequence_and_replays_them() -> None:
    sub = _Sub()
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(_config(endpoint=sub.endpoint, replay_endpoint=replay,
                                   topic="kv@10.0.0.7@m"), KVEventMetrics(CollectorRegistry()))
    pub.start()
    try:
        nxt = _joined(sub, pub)
        big = (1 << 100) + 5                       # kvyard's hashes are wider than 64 bits
        pub.on_event(KVEvent("stored", [big, 7], parent_block_hash=None,
                             token_ids=list(range(32)), block_size=16))
        topic, seq, events = sub.recv()
        assert topic == b"kv@10.0.0.7@m" and seq == nxt
        assert events == [{"type": "BlockStored", "block_hashes": [5, 7],
                           "parent_block_hash": None, "token_ids": list(range(32)),
                           "block_size": 16, "lora_id": None, "medium": "GPU",
                           "lora_name": None}]
        pub.on_event(KVEvent("removed", [7]))
        _, seq2, events = sub.recv()
        assert seq2 == nxt + 1 and events == [{"type": "BlockRemoved", "block_hashes": [7],
                                               "medium": "GPU"}]
        got = _replay(replay, nxt, b"kv@10.0.0.7@m")
        assert [s for s, _ in got] == [nxt, nxt + 1]
        assert got[1][1][0]["type"] == "BlockRemoved"
        assert [s for s, _ in _replay(replay, 0)] == list(range(nxt + 2))
    finally:
        pub.stop()
        sub.close()


def test_overflow_is_published_as_all_blocks_cleared() -> None:
    """Events beyond max_queue_size are not queued; the publisher then sends one
    AllBlocksCleared in place of everything that waited, and counts them."""
    sub = _Sub()
    reg = CollectorRegistry()
    pub = KVEventPublisher(_config(endpoint=sub.endpoint, max_queue_size=3),
                           KVEventMetrics(reg))
    for i in range(5):           # before the thread runs: 3 queued, 2 refused
        pub.on_event(KVEvent("removed", [i]))
    pub.start()
    try:
        # the first batch may be lost to the joining subscription: read the counters
        deadline = time.monotonic() + 30
        while reg.get_sample_value("kvyard:kv_event_batches_total") != 1.0:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # poll interval under a deadline
        assert reg.get_sample_value("kvyard:kv_events_dropped_total") == 5.0
        assert len(pub._buffer) == 1
        assert kve.decode_batch(pub._buffer[0][1])[1] == [{"type": "AllBlocksCleared"}]
        nxt = _joined(sub, pub)   # and later events flow again, in sequence
        pub.on_event(KVEvent("removed", [9]))
        _, seq, events = sub.recv()
        assert seq == nxt and events[0]["block_hashes"] == [9]
    finally:
        pub.stop()
        sub.close()


def test_decode_reads_the_positional_form_too() -> None:
    import msgpack

    payload = msgpack.packb([1.5, [["BlockStored", [1, 2], None, [3] * 32, 16, None, "GPU"],
                                   ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]], 0])
    ts, events = kve.decode_batch(payload)
    assert ts == 1.5 and [e["type"] for e in events] == ["BlockStored", "BlockRemoved",
                                                         "AllBlocksCleared"]
    assert events[0]["block_size"] == 16 and events[1]["block_hashes"] == [1]
    with pytest.raises(ValueError):
        kve.decode_batch(b"\xc1")


def _post(base: str, path: str, doc: dict) -> dict:
    req = urllib.request.Request(base + path, json.dumps(doc).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = r.read()
    try:
        return json.loads(body)
    except ValueError:
        return {}


def test_a_worker_announces_exactly_what_it_caches_evicts_and_clears(tmp_path) -> None:
    sub = _Sub()
    replay = f"tcp://127.0.0.1:{free_port()}"
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": sub.endpoint, "replay_endpoint": replay,
                      "topic": "kv@test@demo"})
    # ~22 float32 blocks: the second prompt evicts the first one's
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len", "256",
                      "--kv-cache-memory-bytes", "16MiB", "--num-threads", "1",
                      "--enable-sleep-mode", "--kv-events-config", cfg], tmp_path / "w.log")
    try:
        sub.sock.poll(100)  # takes the connection in: a SUB subscribes when its owner polls
        stored: dict[int, list[int]] = {}      # announced hash -> its tokens
        removed: set[int] = set()

        def collect(until, what: str) -> None:
            """The whole history so far, from the replay socket (exact, in sequence)."""
            deadline = time.monotonic() + 60
            while True:
                stored.clear()
                removed.clear()
                batches = _replay(replay, 0)
                assert [s for s, _ in batches] == list(range(len(batches)))
                for _, events in batches:
                    for ev in events:
                        if ev["type"] == "BlockStored":
                            assert ev["block_size"] == 16 and ev["medium"] == "GPU"
                            toks = ev["token_ids"]
                            for i, h in enumerate(ev["block_hashes"]):
                                stored[h] = toks[i * 16:(i + 1) * 16]
                        elif ev["type"] == "BlockRemoved":
                            removed.update(ev["block_hashes"])
                        else:
                            stored.clear()
                            removed.add(-1)
                if until():
                    return
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                sub.sock.poll(50)  # a poll interval under the deadline

        prompts = [f"({tag}) " + "Tell me about the rivers of France and their towns. " * 18
                   for tag in ("first", "second")]
        chains = []
        for text in prompts:
            ids = _post(w.base_url, "/tokenize", {"model": DEMO_SERVED_NAME,
                                                  "prompt": text})["tokens"]
            assert len(ids) > 190   # 12 blocks each: two do not fit beside each other
            _post(w.base_url, "/v1/completions", {"model": DEMO_SERVED_NAME, "prompt": text,
                                                  "max_tokens": 2, "temperature": 0})
            chain = [kve.external_hash(h) for h in block_hashes(ids, 16)[:len(ids) // 16]]
            chains.append((chain, ids))
            collect(lambda c=chain: all(h in stored for h in c), "the prompt's blocks stored")
            for i, h in enumerate(chain):    # the same hashes a subscriber computes itself
                assert stored[h] == ids[i * 16:(i + 1) * 16]
        collect(lambda: any(h in removed for h in chains[0][0]), "the first prompt evicted")
        assert not removed & set(chains[1][0])
        live = []                              # the subscriber saw them too, live
        deadline = time.monotonic() + 30
        while not live:
            try:
                live.append(sub.recv(0.5))
            except TimeoutError:
                assert time.monotonic() < deadline, "nothing reached the subscriber"
        assert live[0][0] == b"kv@test@demo"
        _post(w.base_url, "/sleep?level=1", {})
        collect(lambda: -1 in removed and not stored, "AllBlocksCleared on sleep")
        _post(w.base_url, "/wake_up", {})
    finally:
        w.stop()
        sub.close()
