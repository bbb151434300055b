"""`sim_output_tokens`: a simulated answer's natural length, below max_tokens (the SLO
bench's tenants answer at their own lengths, as an EOS would end them)."""
from __future__ import annotations

import aiohttp


async def test_sim_output_tokens_ends_the_answer_early(start_pods) -> None:
    async with start_pods(1) as g, aiohttp.ClientSession() as s:
        base = f"http://{g.pods[0].address}/v1/completions"
        for natural, want in ((5, 5), (100, 20), (0, 20), ("7", 20)):
            body = {"prompt": "hello", "max_tokens": 20, "sim_output_tokens": natural}
            async with s.post(base, json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == want, natural
