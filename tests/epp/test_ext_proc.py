"""The ext_proc server driven by a real grpc.aio client, as Envoy drives it."""
from __future__ import annotations

import asyncio
import json

from kvyard.common.wire import (
    DESTINATION_HEADER, DESTINATION_METADATA_NAMESPACE, DROPPED_REASON_HEADER, PREFILLER_HEADER,
)

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()


def _immediate(resps):
    assert len(resps) == 1, resps
    r = resps[0]
    assert r.WhichOneof("response") == "immediate_response", r
    ir = r.immediate_response
    return ir.status.code, json.loads(ir.body), {h.header.key: h.header.raw_value.decode()
                                                  for h in ir.headers.set_headers}


async def test_routes_with_header_and_metadata_and_ignores_forged_headers(fake_vllm, epp, xp):
    w1, w2 = await fake_vllm(), await fake_vllm()
    app = await epp([w1, w2])
    await xp.wait_for(app.is_ready, what="EPP ready")
    forged = xp.chat_headers(**{DESTINATION_HEADER: "6.6.6.6:80", PREFILLER_HEADER: "6.6.6.6:81"})
    resps = await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(forged), xp.body_msg(CHAT)])
    assert [r.WhichOneof("response") for r in resps] == ["request_headers", "request_body"]
    common = resps[0].request_headers.response
    dest = xp.set_headers(resps[0])[DESTINATION_HEADER]
    assert dest in (w1.address, w2.address)
    assert common.clear_route_cache
    assert PREFILLER_HEADER in common.header_mutation.remove_headers
    meta = resps[0].dynamic_metadata.fields[DESTINATION_METADATA_NAMESPACE].struct_value
    assert meta.fields[DESTINATION_HEADER].string_value == dest
    assert resps[1].request_body.response.status == 0  # CONTINUE, body untouched
    assert not resps[1].request_body.response.HasField("body_mutation")


async def test_headers_only_request_is_routed_at_once(fake_vllm, epp, xp):
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")
    get = {":method": "GET", ":path": "/v1/models"}
    resps = await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(get, end_of_stream=True)])
    assert len(resps) == 1
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address


async def test_split_body_is_reassembled(fake_vllm, epp, xp):
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")
    msgs = [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT[:10], end_of_stream=False),
            xp.body_msg(CHAT[10:])]
    resps = await xp.exchange(app.ports["ext_proc"], msgs)
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address


async def test_client_errors_are_immediate_responses(fake_vllm, epp, xp):
    w = await fake_vllm()
    app = await epp([w], max_body_bytes=1000)
    await xp.wait_for(app.is_ready, what="EPP ready")
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        (json.dumps({"model": 7, "messages": [{"role": "user", "content": "x"}]}).encode(), 400,
         "model"),
        (json.dumps({"model": "m"}).encode(), 400, "messages"),
        (json.dumps({"model": "m", "messages": []}).encode(), 400, "messages"),
        (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
         404, "nope"),
        (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]})
         .encode(), 413, "exceeds"),
    ]
    for body, status, text in cases:
        resps = await xp.exchange(app.ports["ext_proc"],
                                  [xp.headers_msg(xp.chat_headers()), xp.body_msg(body)])
        code, err, hdrs = _immediate(resps)
        assert code == status, (body[:40], code)
        assert text in err["error"]["message"]
        assert hdrs["content-type"] == "application/json"
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["type"] == "invalid_request_error"
        assert isinstance(err["error"]["code"], str)
    comp = {":method": "POST", ":path": "/v1/completions"}
    resps = await xp.exchange(app.ports["ext_proc"], [
        xp.headers_msg(comp), xp.body_msg(json.dumps({"model": "m"}).encode())])
    assert _immediate(resps)[0] == 400
    errors = app.metrics.registry.get_sample_value
    assert errors("kvyard_epp_errors_total", {"reason": "invalid_json"}) == 1
    assert errors("kvyard_epp_errors_total", {"reason": "model_not_found"}) == 1


async def test_no_endpoint_is_503_and_server_keeps_serving(epp, xp, free_port):
    # The waiting room holds the request (Envoy is told to wait), then its TTL ends it.
    app = await epp([], no_endpoint_ttl_s=0.05)
    for _ in range(2):
        resps = await xp.exchange(app.ports["ext_proc"],
                                  [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
        assert resps[0].HasField("override_message_timeout"), resps
        code, err, hdrs = _immediate(resps[1:])
        assert code == 503 and err["error"]["type"] == "server_error"
        assert err["error"]["code"] == "rejected-no-endpoints"
        assert hdrs[DROPPED_REASON_HEADER] == "rejected-no-endpoints" and hdrs["retry-after"]


async def test_internal_error_is_500_and_next_request_is_served(fake_vllm, epp, xp):
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")

    class Boom:  # a scorer with a bug
        name = "boom"

        def score(self, req, eps):
            raise RuntimeError("bug")

    app.director.scheduler.scorers.append((Boom(), 1.0))
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
    assert _immediate(resps)[0] == 500
    app.director.scheduler.scorers.pop()
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address


async def test_sheddable_request_gets_429_when_saturated(fake_vllm, epp, xp):
    w = await fake_vllm(waiting=10)  # 10/5 = saturation 2
    app = await epp([w])
    await xp.wait_for(lambda: app.pool.get(w.address).waiting == 10, what="scrape")
    shed = xp.chat_headers(**{"x-gateway-inference-objective": "-1"})
    code, err, hdrs = _immediate(await xp.exchange(
        app.ports["ext_proc"], [xp.headers_msg(shed), xp.body_msg(CHAT)]))
    assert code == 429 and hdrs[DROPPED_REASON_HEADER] == "rejected-saturated"
    assert err["error"]["type"] == "rate_limit_error"
    assert err["error"]["code"] == "rejected-saturated"
    # Critical traffic is held while the pool is saturated, and routed once it is not.
    held = asyncio.ensure_future(xp.exchange(
        app.ports["ext_proc"], [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)]))
    await xp.wait_for(lambda: app.demand.queued["decode"] == 1, what="queued")
    assert not held.done()
    w.waiting = 0
    resps = await asyncio.wait_for(held, 5)
    assert resps[0].HasField("override_message_timeout")
    assert xp.set_headers(resps[1])[DESTINATION_HEADER] == w.address
    await xp.wait_for(lambda: app.pool.get(w.address).waiting == 0, what="scrape")
    resps = await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(shed), xp.body_msg(CHAT)])
    assert resps[0].WhichOneof("response") == "request_headers"


async def test_body_ended_by_trailers_is_routed(fake_vllm, epp, xp):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")
    resps = await xp.exchange(app.ports["ext_proc"], [
        xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT, end_of_stream=False),
        ep.ProcessingRequest(request_trailers=ep.HttpTrailers())])
    assert [r.WhichOneof("response") for r in resps] == [
        "request_headers", "request_body", "request_trailers"]
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address
