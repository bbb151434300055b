"""Replicas with precise prefix routing, fed the same real ZMQ KV events (the vLLM-style
publisher of test_kv_subscriber, with replay): two replicas sharing their picks decide
as one EPP fed the same events and requests would, request for request."""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

import kvyard.epp
from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.epp.prompt import LazyPrompt
from kvyard.epp.scheduling.types import SchedRequest

from .conftest import wait_for
from .test_kv_subscriber import BS, Publisher, _chain, _stored

PRECISE = str(Path(kvyard.epp.__file__).parent / "scheduler.precise.example.yaml")
N = 4


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def _app(pubs: list[Publisher]) -> EppApp:
    app = EppApp(EppConfig(model="none", flow_control=False, host="127.0.0.1", config=PRECISE,
                           replica_port=0))
    app.pool.set_source("t", [EndpointSpec(f"10.0.0.{i + 1}:8000", kv_events=p.endpoint,
                                           kv_replay=p.replay) for i, p in enumerate(pubs)])
    for e in app.pool.all():
        e.last_ok = time.monotonic()
    app.kv_events.sync()
    return app


def _pick(app: EppApp, tokens: list[int]) -> str:
    d = app.director.schedule(SchedRequest("m", LazyPrompt.of_ids(tokens, 64, 0)))
    assert d is not None
    return d.endpoint.address


def _requests(chains: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """Prompts extending what pods 0 and 1 cached, and a burst of a prefix nobody holds."""
    rng = random.Random(7)
    new = [rng.randrange(1, 50_000) for _ in range(8 * BS)]
    out = []
    for i in range(12):
        base = chains[i % 2][1][: 6 * BS] if i % 3 else new
        out.append(base + [rng.randrange(1, 50_000) for _ in range(BS + i)])
    return out


@pytest.mark.parametrize("shared", [True, False])
async def test_replicas_fed_the_same_events_pick_as_one_epp(ctx, shared: bool) -> None:
    """Without the shared picks (the control) the same replicas part ways."""
    pubs = [Publisher(ctx) for _ in range(N)]
    chains = [_chain(10 + i, 6) for i in range(2)]
    for pub, chain in zip(pubs, chains):  # before anyone subscribes: caught up by replay
        await pub.publish([_stored(chain, 0, 6)])
    lone, a, b = _app(pubs), _app(pubs), _app(pubs)
    apps = (lone, a, b)
    try:
        await wait_for(lambda: all(x.kv_events.index.stored >= 12 for x in apps), timeout=20,
                       what="every replica's index from the replayed events")
        want = [_pick(lone, t) for t in _requests(chains)]
        if not shared:
            a.director.on_pick = b.director.on_pick = None
        await a.replicas.start()
        await b.replicas.start()
        await a.replicas.connect([f"127.0.0.1:{b.replicas.port}"])
        await b.replicas.connect([f"127.0.0.1:{a.replicas.port}"])
        for x, y in ((a, b), (b, a)):
            await wait_for(lambda x=x, y=y: x.replicas.announce() or y.replicas.messages > 0,
                           what="the replica link")
        got = []
        for i, t in enumerate(_requests(chains)):
            x, y = (a, b) if i % 2 == 0 else (b, a)
            got.append(_pick(x, t))
            if shared:
                await wait_for(lambda y=y, n=i // 2 + 1: y.replicas.received >= n,
                               what="the peer's pick")
        if not shared:
            assert got != want
            return
        assert got == want
        assert {"10.0.0.1:8000", "10.0.0.2:8000"} <= set(want)  # the events steered them
        burst = {w for w, t in zip(want, _requests(chains)) if t[:BS] == _requests(chains)[0][:BS]}
        assert len(burst) == 1  # the new prefix's burst stayed together across replicas
    finally:
        for x in apps:
            if x.replicas._ctx is not None:
                await x.replicas.close()
            await x.kv_events.close()
        for p in pubs:
            await p.close()
