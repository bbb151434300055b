"""Active-active EPP replicas (epp/replicas/): two replicas over a real ZMQ pub/sub
decide as one EPP would, a burst of one prefix split across them lands on one
endpoint only because picks are shared, and a late replica catches up before it
reports ready."""
from __future__ import annotations

import json
import time

from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.epp.replicas.peers import DnsPeers, parse_peers
from kvyard.epp.replicas.wire import Pick, decode, encode
from kvyard.epp.scheduling.types import Decision

from .conftest import wait_for

HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}
N = 4


def _chat(prefix: str, i: int) -> bytes:
    text = f"{prefix} " * 60 + f" question {i}"
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def _app(**cfg) -> EppApp:
    app = EppApp(EppConfig(model="none", flow_control=False, host="127.0.0.1", **cfg))
    app.pool.set_source("t", [EndpointSpec(f"10.0.0.{i}:8000") for i in range(1, N + 1)])
    for e in app.pool.all():
        e.last_ok = time.monotonic()
    return app


def _pick(app: EppApp, body: bytes) -> str:
    d = app.director.handle(HEADERS, body)
    assert type(d) is Decision
    return d.endpoint.address


async def _pair() -> tuple[EppApp, EppApp]:
    """Two replicas, each subscribed to the other, the links proven up."""
    a, b = _app(replica_port=0), _app(replica_port=0)
    await a.replicas.start()
    b.cfg.peers = []
    await b.replicas.start()
    await a.replicas.connect([f"127.0.0.1:{b.replicas.port}"])
    await b.replicas.connect([f"127.0.0.1:{a.replicas.port}"])
    for x, y in ((a, b), (b, a)):  # PUB/SUB joins late: announce until the peer hears
        await wait_for(lambda x=x, y=y: x.replicas.announce() or y.replicas.messages > 0,
                       what="the replica link")
    return a, b


async def _delivered(frm: EppApp, to: EppApp, sent: int) -> None:
    await wait_for(lambda: to.replicas.received >= sent, what="the peer's pick")


def _traffic() -> list[bytes]:
    """Mixed traffic: a few prefixes, each asked several times, interleaved."""
    return [_chat(f"topic{j % 5}", i) for i, j in enumerate([0, 1, 2, 0, 3, 1, 4, 0, 2, 2,
                                                               3, 4, 1, 0, 5, 5, 6, 0])]


async def test_two_replicas_sharing_picks_decide_as_one_epp():
    lone = _app(replica_port=0)  # stable ties, no peers: the single-EPP reference
    want = [_pick(lone, body) for body in _traffic()]
    a, b = await _pair()
    try:
        got = []
        for i, body in enumerate(_traffic()):  # Envoy's round robin over the replicas
            x, y = (a, b) if i % 2 == 0 else (b, a)
            got.append(_pick(x, body))
            await _delivered(x, y, i // 2 + 1)
        assert got == want
        assert len(set(want)) > 1  # the traffic spreads: the agreement is not trivial
    finally:
        await a.replicas.close()
        await b.replicas.close()


async def test_same_state_same_pick_without_any_message():
    """Stable tie-breaking: two replicas fed the same requests pick alike on their own."""
    a, b = _app(replica_port=0), _app(replica_port=0)
    assert [_pick(a, x) for x in _traffic()] == [_pick(b, x) for x in _traffic()]


async def _burst(shared: bool, prefix: str) -> set[str]:
    """Replica A has served three requests B never heard of (without sharing); then a
    burst of one new prefix alternates between them."""
    if shared:
        a, b = await _pair()
    else:
        a, b = _app(replica_port=0), _app(replica_port=0)
        await a.replicas.start()
        await b.replicas.start()
    try:
        for i in range(3):
            _pick(a, _chat(f"warm{i}", i))
        if shared:
            await _delivered(a, b, 3)
        seen = set()
        for i in range(6):
            x, y = (b, a) if i % 2 == 0 else (a, b)
            seen.add(_pick(x, _chat(prefix, i)))
            if shared:
                await _delivered(x, y, 3 * (x is a) + i // 2 + 1)
        return seen
    finally:
        await a.replicas.close()
        await b.replicas.close()


async def test_a_burst_split_across_replicas_lands_together_only_with_shared_picks():
    prefixes = [f"burst{k}" for k in range(4)]
    for p in prefixes:
        assert len(await _burst(True, p)) == 1
    # Alone, B breaks its first tie by the prompt (a 1-in-4 chance of meeting A's choice,
    # the endpoint A left idle): over four prefixes the replicas disagree at least once.
    assert any([len(await _burst(False, p)) > 1 for p in prefixes])


async def test_a_late_replica_catches_up_before_it_is_ready():
    a = _app(replica_port=0)
    await a.replicas.start()
    try:
        picked = {_pick(a, _chat("early", i)) for i in range(3)}
        assert len(picked) == 1
        late = _app(peers=[f"127.0.0.1:{a.replicas.port}"], replica_port=0)
        assert not late.is_ready()  # NOT_SERVING until it has asked its peers
        await late.replicas.start()
        await wait_for(lambda: late.replicas.caught_up, what="the catch-up")
        assert late.is_ready() and late.replicas.applied == 3
        assert _pick(late, _chat("early", 9)) in picked  # it knows where the prefix went
        await late.replicas.close()
    finally:
        await a.replicas.close()


async def test_a_lone_replica_with_silent_peers_serves_after_the_timeout():
    app = _app(peers=["127.0.0.1:1"], replica_port=0, catch_up_timeout_s=0.2)
    await app.replicas.start()
    try:
        await wait_for(lambda: app.replicas.caught_up, what="the timeout")
        assert app.is_ready()
    finally:
        await app.replicas.close()


def test_wire_round_trip_and_peer_parsing():
    p = Pick("10.0.0.1:8000", [1, 2 ** 63], {16: [3, 4]}, 12.5)
    sender, [q] = decode(encode(b"r1", [p]))
    assert sender == b"r1" and q == p
    assert parse_peers("a:1, b:2,") == ["a:1", "b:2"]
    assert DnsPeers.parse("epp-peers.ns.svc:9005").port == 9005
    for bad in ("a", "a:x"):
        try:
            parse_peers(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


class _Records:
    """A headless Service's A records, as the test sets them."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    async def resolve(self) -> list[str]:
        return self.addresses


async def test_peers_from_dns_follow_the_records():
    """--peers-dns: every A record of the headless Service is a peer; a record that goes
    away is disconnected (a pod that left)."""
    a = _app(replica_port=0)
    await a.replicas.start()
    b = _app(peers_dns="epp-replicas.ns.svc:9005", replica_port=0)
    assert b.replicas.dns.name == "epp-replicas.ns.svc" and b.replicas.dns.port == 9005
    b.replicas.dns = records = _Records([f"127.0.0.1:{a.replicas.port}"])
    b.replicas.dns_period_s = 0.01
    try:
        await b.replicas.start()
        await wait_for(lambda: b.replicas.caught_up, what="the catch-up")
        assert b.replicas.snapshot()["peers"] == [f"127.0.0.1:{a.replicas.port}"]
        records.addresses = []
        await wait_for(lambda: b.replicas.snapshot()["peers"] == [], what="the peer gone")
    finally:
        await a.replicas.close()
        await b.replicas.close()
