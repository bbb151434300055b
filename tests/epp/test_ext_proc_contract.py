"""The EPP's side of the error contract: bad input is a 4xx in OpenAI's shape
(never a 500), the stream's message order is enforced, and a request without
`model` is routed as the worker would serve it (vLLM's default model)."""
from __future__ import annotations

import json

import grpc
import pytest

from kvyard.common.wire import DESTINATION_HEADER

BAD_BODIES = [
    # a lone surrogate is valid JSON but no valid text
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_encoding"),
    (b'{"model": "m", "prompt": "a\\udfffb"}', "invalid_encoding"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x", "\\ud800": 1}]}',
     "invalid_encoding"),
    # nested far past Python's recursion limit, and just past the bound
    (b'{"model": "m", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", "too_deep"),
    (b'{"model": "m", "x": ' + b"[" * 70 + b"]" * 70 + b', "prompt": "hi"}', "too_deep"),
    (json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
     "invalid_role"),
    (json.dumps({"model": "m", "messages": [{"content": "x"}]}).encode(), "invalid_role"),
    (json.dumps({"model": "", "prompt": "x"}).encode(), "invalid_model"),
]


@pytest.mark.parametrize("body,code", BAD_BODIES, ids=[c for _, c in BAD_BODIES])
async def test_bad_input_is_a_400_in_openai_shape(fake_vllm, epp, xp, body, code):
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")
    hdrs = xp.chat_headers() if b"messages" in body else {":method": "POST",
                                                            ":path": "/v1/completions"}
    resps = await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(hdrs), xp.body_msg(body)])
    assert len(resps) == 1 and resps[0].WhichOneof("response") == "immediate_response"
    ir = resps[0].immediate_response
    err = json.loads(ir.body)["error"]
    assert ir.status.code == 400, err
    assert err["code"] == code and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    # and the EPP keeps routing
    ok = json.dumps({"model": "m", "messages": [{"role": "developer", "content": "hi"}]})
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(ok.encode())])
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address


async def test_request_without_model_is_routed(fake_vllm, epp, xp):
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(body)])
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address


@pytest.mark.parametrize("order", ["body_first", "trailers_first", "headers_twice"])
async def test_messages_out_of_order_end_the_stream_with_invalid_argument(fake_vllm, epp, xp,
                                                                          order):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    # Each stream stops at its first out-of-order message: the EPP ends the stream there, and
    # a client write racing that end fails locally as INTERNAL, hiding the EPP's status.
    msgs = {"body_first": [xp.body_msg(chat)],
            "trailers_first": [ep.ProcessingRequest(request_trailers=ep.HttpTrailers())],
            "headers_twice": [xp.headers_msg(xp.chat_headers()),
                              xp.headers_msg(xp.chat_headers())]}[order]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await xp.exchange(app.ports["ext_proc"], msgs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    get = app.metrics.registry.get_sample_value
    assert get("kvyard_epp_errors_total", {"reason": "protocol"}) == 1
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(chat)])
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address
