"""P/D on simulated pods: a decode pod given a signed prefill target has that prefill pod
prefill the prompt, then pays the transfer instead; an unsigned target is refused."""
from __future__ import annotations

import aiohttp

from kvyard.common import pd_auth, wire


async def test_decode_pod_prefills_on_the_signed_target(start_pods) -> None:
    key = b"k" * 32
    async with start_pods(2, roles=["prefill", "decode"], pd_key=key) as g, \
            aiohttp.ClientSession() as s:
        prefill, decode = g.pods
        prompt = "a long prompt for the prefill pod " * 20
        hdr = {wire.PREFILLER_HEADER: prefill.address,
               wire.PREFILLER_AUTH_HEADER: pd_auth.sign(key, prefill.address)}
        async with s.post(f"http://{decode.address}/v1/completions", headers=hdr,
                          json={"prompt": prompt, "max_tokens": 4}) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["usage"]["completion_tokens"] == 4
        assert decode.handoffs == 1 and decode.fallbacks == 0
        n = doc["usage"]["prompt_tokens"]
        assert prefill.engine.counters.prompt_tokens == n    # the prefill ran there
        assert prefill.engine.counters.generation_tokens == 1
        m = decode.engine.model
        assert m.transfer_mean(n) < m.prefill_mean(n)  # what the decode pod paid instead

        bad = {wire.PREFILLER_HEADER: prefill.address}
        async with s.post(f"http://{decode.address}/v1/completions", headers=bad,
                          json={"prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 403
        assert decode.rejected == 1
        async with s.get(f"http://{decode.address}/metrics") as r:
            assert f'{wire.M_PD_HANDOFFS}{{path="sim"}} 1' in await r.text()
