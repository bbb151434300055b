"""Flow control through the EPP's real ext_proc server: the waiting room, saturation
queues, TTLs, disconnects, shutdown, bounds and metrics."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvyard.common.wire import DESTINATION_HEADER, DROPPED_REASON_HEADER, QUEUE_TTL_HEADER
from kvyard.epp.flow.config import parse_flow_config
from kvyard.epp.flow.controller import FlowController
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.epp.scheduling.plugin_config import ConfigError

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()


def _send(xp, app, **headers):
    return asyncio.ensure_future(xp.exchange(
        app.ports["ext_proc"], [xp.headers_msg(xp.chat_headers(**headers)), xp.body_msg(CHAT)]))


def _routed_to(xp, resps) -> str:
    assert resps[0].HasField("override_message_timeout"), resps  # Envoy was told to wait
    assert resps[1].WhichOneof("response") == "request_headers", resps
    return xp.set_headers(resps[1])[DESTINATION_HEADER]


def _refusal(resps):
    r = next(r for r in resps if r.WhichOneof("response") == "immediate_response")
    ir = r.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, json.loads(ir.body)["error"], hdrs


def _sample(app, name, **labels):
    return app.metrics.registry.get_sample_value(name, labels)


async def test_waiting_room_parks_then_releases_all_when_an_endpoint_is_ready(
        fake_vllm, epp, xp):
    app = await epp([])
    woken: list[str] = []
    app.demand.subscribe(woken.append)
    # Present, at 0, before anything happened (KEDA reads absent series as 0).
    q = dict(pool="default", priority="0", stage="waiting_room")
    assert _sample(app, "kvyard_epp_flow_queue_size", **q) == 0
    assert _sample(app, "kvyard_epp_flow_requests_total", pool="default",
                   outcome="dispatched") == 0
    held = [_send(xp, app) for _ in range(3)]
    await xp.wait_for(lambda: app.demand.parked["decode"] == 3, what="3 parked")
    assert woken == ["decode"] * 3
    assert _sample(app, "kvyard_epp_flow_queue_size", **q) == 3
    assert _sample(app, "kvyard_epp_flow_queue_bytes", **q) == 3 * len(CHAT)
    assert not any(h.done() for h in held)
    w = await fake_vllm()
    app.pool.set_source("static", [EndpointSpec(w.address)])  # discovery sees it
    got = await asyncio.wait_for(asyncio.gather(*held), 5)
    assert [_routed_to(xp, r) for r in got] == [w.address] * 3
    assert app.demand.parked["decode"] == 0
    assert _sample(app, "kvyard_epp_flow_queue_size", **q) == 0
    assert _sample(app, "kvyard_epp_flow_requests_total", pool="default",
                   outcome="dispatched") == 3
    assert _sample(app, "kvyard_epp_flow_wait_seconds_count", pool="default",
                   stage="waiting_room") == 3


async def test_ttl_header_ends_the_wait_with_a_503_body(epp, xp):
    app = await epp([])
    resps = await asyncio.wait_for(_send(xp, app, **{QUEUE_TTL_HEADER: "50"}), 5)
    code, err, hdrs = _refusal(resps)
    assert code == 503 and err["type"] == "server_error"
    assert err["code"] == "rejected-no-endpoints" and "in time" in err["message"]
    assert hdrs[DROPPED_REASON_HEADER] == "rejected-no-endpoints" and int(hdrs["retry-after"]) > 0
    assert app.demand.parked["decode"] == 0
    assert _sample(app, "kvyard_epp_flow_requests_total", pool="default",
                   outcome="expired") == 1


async def test_a_client_that_leaves_is_dropped_from_the_queue_at_once(epp, xp):
    app = await epp([])
    held = _send(xp, app)
    await xp.wait_for(lambda: app.demand.parked["decode"] == 1, what="parked")
    held.cancel()  # the gRPC stream is cancelled, as Envoy does when its client goes
    await xp.wait_for(lambda: app.demand.parked["decode"] == 0, what="dropped")
    assert _sample(app, "kvyard_epp_flow_requests_total", pool="default",
                   outcome="cancelled") == 1
    assert app.flow.count == 0 and app.flow.nbytes == 0


async def test_shutdown_answers_held_requests_cleanly(epp, xp):
    app = await epp([])
    held = _send(xp, app)
    await xp.wait_for(lambda: app.demand.parked["decode"] == 1, what="parked")
    await app.stop()
    code, err, hdrs = _refusal(await asyncio.wait_for(held, 5))
    assert code == 503 and err["code"] == "rejected-shutting-down"
    assert hdrs["retry-after"]


async def test_a_full_queue_is_a_429(epp, xp, tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("flowControl: {maxRequests: 2}\n")
    app = await epp([], config=str(cfg))
    held = [_send(xp, app) for _ in range(2)]
    await xp.wait_for(lambda: app.demand.parked["decode"] == 2, what="2 parked")
    code, err, hdrs = _refusal(await asyncio.wait_for(_send(xp, app), 5))
    assert code == 429 and err["code"] == "rejected-queue-full"
    assert hdrs[DROPPED_REASON_HEADER] == "rejected-queue-full"
    for h in held:
        h.cancel()


async def test_saturation_queue_serves_priorities_in_order_and_ids_fairly(
        fake_vllm, epp, xp, monkeypatch):
    w = await fake_vllm(waiting=10)  # 10 queued / 5 = saturation 2
    app = await epp([w])
    await xp.wait_for(lambda: app.pool.get(w.address).waiting == 10, what="scrape")
    names: dict[int, str] = {}
    order: list[str] = []
    dispatch = FlowController._dispatch

    def recording(self, waiter):
        ok = dispatch(self, waiter)
        if ok:
            order.append(names[id(waiter)])
        return ok
    monkeypatch.setattr(FlowController, "_dispatch", recording)
    sends = [("a1", "0", "A"), ("a2", "0", "A"), ("a3", "0", "A"), ("b1", "0", "B"),
             ("hi", "5", "C")]
    tasks = []
    for name, prio, flow in sends:
        tasks.append(_send(xp, app, **{"x-gateway-inference-objective": prio,
                                       "x-llm-d-inference-fairness-id": flow}))
        await xp.wait_for(lambda k=len(tasks): app.flow.count == k, what=f"{name} queued")
        new = [wt for b in app.flow.bands.values() for q in b.flows.values() for wt in q
               if id(wt) not in names]
        names[id(new[0])] = name
    # A sheddable request is still shed at once while saturated.
    code, err, _ = _refusal(await _send(xp, app, **{"x-gateway-inference-objective": "-1"}))
    assert code == 429 and err["code"] == "rejected-saturated"
    assert app.demand.queued["decode"] == 5 and not order
    w.waiting = 0
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["hi", "a1", "b1", "a2", "a3"]
    assert app.demand.queued["decode"] == 0


async def test_saturation_ttl_is_a_429(fake_vllm, epp, xp):
    w = await fake_vllm(waiting=10)
    app = await epp([w], queue_ttl_s=0.05)
    await xp.wait_for(lambda: app.pool.get(w.address).waiting == 10, what="scrape")
    code, err, hdrs = _refusal(await asyncio.wait_for(_send(xp, app), 5))
    assert code == 429 and err["code"] == "rejected-ttl-expired"
    assert hdrs[DROPPED_REASON_HEADER] == "rejected-ttl-expired"


async def test_without_flow_control_nothing_is_held(epp, xp):
    app = await epp([], flow_control=False)
    code, err, _ = _refusal(await asyncio.wait_for(_send(xp, app), 5))
    assert code == 503 and err["code"] == "rejected-no-endpoints"


@pytest.mark.parametrize("raw, path", [
    ({"maxRequests": 0}, "flowControl.maxRequests"),
    ({"noEndpointRequestTTL": "0s"}, "flowControl.noEndpointRequestTTL"),
    ({"defaultRequestTTL": "soon"}, "flowControl.defaultRequestTTL"),
    ({"noEndpointRequestTTL": "1h"}, "flowControl.noEndpointRequestTTL"),
    ({"bogus": 1}, "flowControl.bogus"),
    ({"priorityBands": [{"priority": 1}, {"priority": 1}]}, "flowControl.priorityBands[1]"),
    ({"priorityBands": [{"priority": 0, "maxBytes": -1}]},
     "flowControl.priorityBands[0].maxBytes"),
])
def test_bad_flow_config_names_its_path(raw, path):
    with pytest.raises(ConfigError) as e:
        parse_flow_config(raw)
    assert path in str(e.value)


def test_flow_config_durations_and_bands():
    c = parse_flow_config({"defaultRequestTTL": "500ms", "noEndpointRequestTTL": "10m",
                           "priorityBands": [{"priority": -1, "maxRequests": 7}]})
    assert c.default_ttl_s == 0.5 and c.no_endpoint_ttl_s == 600.0
    assert c.band(-1).max_requests == 7 and c.band(0).max_requests == c.max_requests


def test_example_config_documents_the_flow_control_defaults():
    from pathlib import Path

    import kvyard.epp
    from kvyard.epp.flow.config import FlowConfig
    from kvyard.epp.scheduling.config import load_config
    raw = load_config(Path(kvyard.epp.__file__).parent / "scheduler.example.yaml")
    assert parse_flow_config(raw["flowControl"]) == FlowConfig()


async def test_queued_requests_move_to_the_waiting_room_when_the_pool_dies(fake_vllm, epp, xp):
    w = await fake_vllm(waiting=10)
    app = await epp([w])
    await xp.wait_for(lambda: app.pool.get(w.address).waiting == 10, what="scrape")
    held = _send(xp, app)
    await xp.wait_for(lambda: app.demand.queued["decode"] == 1, what="queued")
    woken: list[str] = []
    app.demand.subscribe(woken.append)
    await w.stop()  # refused scrapes: down at once
    await xp.wait_for(lambda: app.demand.parked["decode"] == 1, what="moved to the room")
    assert app.demand.queued["decode"] == 0 and woken == ["decode"]
    w.waiting = 0
    await w.start()  # same port: back on the next good scrape
    assert _routed_to(xp, await asyncio.wait_for(held, 5)) == w.address


async def test_one_deeply_queued_endpoint_holds_nothing_while_another_has_room(
        fake_vllm, epp, xp):
    busy, idle = await fake_vllm(waiting=50), await fake_vllm()
    app = await epp([busy, idle])
    await xp.wait_for(lambda: app.pool.get(busy.address).waiting == 50
                      and app.pool.get(idle.address).last_ok > 0, what="scrape")
    resps = await asyncio.wait_for(_send(xp, app), 5)
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == idle.address  # not held
    assert app.flow.count == 0
