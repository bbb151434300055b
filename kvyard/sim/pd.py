"""P/D on the simulator: a decode pod's prefill leg on the prefill pod the EPP chose.

The leg is the worker's (workers/pd): the prompt's token ids to the prefill pod's
/v1/completions with `max_tokens` 1 and `kv_transfer_params.do_remote_decode`, so the
prefill pod queues, batches, caches and publishes KV events exactly as for any request.
The decode pod then pays `kv_transfer_latency + tokens x kv_transfer_time_per_token`
(the engine's step for a remote-prefilled request) instead of the prefill. A failed leg
falls back to a local prefill, counted, as the worker does.
"""
from __future__ import annotations

import logging

from kvyard.common import wire
from kvyard.sim.pod import Pod

log = logging.getLogger("kvyard.sim.pd")


async def remote_prefill(pod: Pod, target: str, prompt_ids: list[int]) -> bool:
    import aiohttp

    if pod.session is None:
        pod.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    body = {"model": pod.served[0], "prompt": prompt_ids, "max_tokens": 1, "stream": False,
            wire.KV_TRANSFER_PARAMS: {"do_remote_decode": True, "do_remote_prefill": False}}
    try:
        async with pod.session.post(f"http://{target}/v1/completions", json=body) as r:
            if r.status != 200:
                log.warning("%s: prefill leg on %s answered %d", pod.address, target, r.status)
                return False
            doc = await r.json()
    except (aiohttp.ClientError, OSError, ValueError) as e:
        log.warning("%s: prefill leg on %s failed: %s", pod.address, target, e)
        return False
    return isinstance(doc, dict) and isinstance(doc.get(wire.KV_TRANSFER_PARAMS), dict)
