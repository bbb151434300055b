"""What a latency prediction reads: the endpoint's scraped state, the EPP's own
requests in flight on it, and the request's uncached prompt tokens there.

TTFT features: 1, uncached prompt kilotokens (the prompt minus the prefix scorer's
match on that endpoint), the prefill queued ahead of it (kilotokens the EPP routed there
that have no first token yet, their count, and the engine's own scraped
`kvyard:prompt_tokens_pending` where exported), waiting (+ picks not yet scraped),
running, the decode kilotokens still to come there and the recent prefill rate.
TPOT features: 1, the batch it decodes in (running, or the EPP's own requests there if
more), the rate of uncached prompt tokens the EPP has been sending there (kilotokens/s,
decayed over `RATE_TAU_S`: with chunked prefill, prompts that arrive while a request
decodes share its steps, so the recent prefill rate predicts the stalls ahead), the
prefill queued there, 1 / the predicted output length (the steps right after the first
token still carry the prefill queued with it) and the prompts still prefilling.
Chosen by held-out error on `kvyard bench slo` traces (`kvyard.bench.slo_fit`); the
endpoint's role selects the model (see `predictor.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pool.endpoints import Endpoint

import math

TTFT_DIM = 9
TPOT_DIM = 6
RATE_TAU_S = 2.0


@dataclass(slots=True)
class EndpointLoad:
    """The EPP's own requests on one endpoint, as it routed and observed them."""

    prefill_tokens: float = 0.0   # uncached prompt tokens routed there, no first token yet
    prefilling: int = 0           # those requests
    decoding: int = 0             # requests past their first token, not finished
    decode_tokens: float = 0.0    # their predicted output tokens still to come
    prefill_rate: float = 0.0     # uncached prompt tokens/s routed there, decayed
    rate_at: float = 0.0          # when prefill_rate was last decayed

    def routed(self, uncached: float, now: float) -> None:
        self.prefill_rate = self.rate(now) + uncached / RATE_TAU_S
        self.rate_at = now

    def rate(self, now: float) -> float:
        # a request decided before the last routing (now < rate_at) sees the rate as is
        return self.prefill_rate * math.exp(-max(0.0, now - self.rate_at) / RATE_TAU_S)


def ttft_features(ep: Endpoint, load: EndpointLoad, uncached: float, now: float) -> list[float]:
    return [1.0, uncached / 1000.0, load.prefill_tokens / 1000.0,
            (ep.prompt_tokens_pending or 0.0) / 1000.0, float(load.prefilling),
            ep.waiting + ep.pending, ep.running, load.decode_tokens / 1000.0,
            load.rate(now) / 1000.0]


def tpot_features(ep: Endpoint, load: EndpointLoad, now: float, output: float) -> list[float]:
    busy = max(ep.running, float(load.decoding + load.prefilling))
    queued = (ep.prompt_tokens_pending or 0.0) + load.prefill_tokens
    return [1.0, busy, load.rate(now) / 1000.0, queued / 1000.0, 1.0 / max(1.0, output),
            float(load.prefilling)]
