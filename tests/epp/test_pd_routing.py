"""P/D through the ext_proc server: the decode pod is the destination and, for a
prompt mostly uncached there, the prefill pod rides in x-prefiller-host-port."""
from __future__ import annotations

import json
from pathlib import Path

import kvyard.epp
from kvyard.common.wire import DESTINATION_HEADER, PREFILLER_HEADER
from kvyard.epp.pool.endpoints import EndpointSpec

PD = str(Path(kvyard.epp.__file__).parent / "scheduler.pd.example.yaml")


async def test_uncached_prompt_gets_a_prefiller_and_a_cached_one_does_not(fake_vllm, epp, xp):
    pre, dec = await fake_vllm(), await fake_vllm()
    app = await epp([EndpointSpec(pre.address, "prefill"), EndpointSpec(dec.address, "decode")],
                    config=PD)
    await xp.wait_for(app.is_ready, what="EPP ready")
    text = "the same long system prompt, word after word. " * 120  # ~1,400 pseudo tokens
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    forged = xp.chat_headers(**{PREFILLER_HEADER: "6.6.6.6:1"})
    resps = await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(forged), xp.body_msg(body)])
    hdrs = xp.set_headers(resps[0])
    assert hdrs[DESTINATION_HEADER] == dec.address and hdrs[PREFILLER_HEADER] == pre.address
    await app.finisher.settle()  # the decode pod learned the whole prompt
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(body)])
    hdrs = xp.set_headers(resps[0])
    assert hdrs[DESTINATION_HEADER] == dec.address and PREFILLER_HEADER not in hdrs
    common = resps[0].request_headers.response
    assert PREFILLER_HEADER in common.header_mutation.remove_headers  # a client copy never passes


async def test_prefill_target_is_signed_with_the_pool_key(fake_vllm, epp, xp, tmp_path):
    from kvyard.common import pd_auth
    from kvyard.common.wire import PREFILLER_AUTH_HEADER
    key = tmp_path / "pd.key"
    key.write_text("k" * 32)
    pre, dec = await fake_vllm(), await fake_vllm()
    app = await epp([EndpointSpec(pre.address, "prefill"), EndpointSpec(dec.address, "decode")],
                    config=PD, pd_key_file=str(key))
    await xp.wait_for(app.is_ready, what="EPP ready")
    text = "another long prompt nobody has seen. " * 150
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    forged = xp.chat_headers(**{PREFILLER_AUTH_HEADER: "1.forged"})
    hdrs = xp.set_headers((await xp.exchange(app.ports["ext_proc"],
                                             [xp.headers_msg(forged), xp.body_msg(body)]))[0])
    token = hdrs[PREFILLER_AUTH_HEADER]
    assert pd_auth.verify(b"k" * 32, pre.address, token) is None
    assert pd_auth.verify(b"k" * 32, "6.6.6.6:1", token) == "bad prefill signature"
    assert pd_auth.verify(b"x" * 32, pre.address, token) == "bad prefill signature"


async def test_a_prefill_pool_at_zero_is_woken_and_decode_serves_alone(fake_vllm, epp, xp):
    dec = await fake_vllm()
    app = await epp([EndpointSpec(dec.address, "decode")], config=PD)
    woken: list[str] = []
    app.demand.subscribe(woken.append)
    await xp.wait_for(app.is_ready, what="EPP ready")
    text = "a long prompt for a pool whose prefill pods are scaled to zero. " * 100
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(body)])
    hdrs = xp.set_headers(resps[0])  # routed at once, not held
    assert hdrs[DESTINATION_HEADER] == dec.address and PREFILLER_HEADER not in hdrs
    assert woken == ["prefill"]
    short = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(xp.chat_headers()),
                                              xp.body_msg(short)])
    assert woken == ["prefill"]  # a prompt the decider keeps local wakes nobody
