"""What a latency prediction reads: the endpoint's scraped state, the EPP's own
requests in flight on it, and the request's uncached prompt tokens there.

TTFT features: 1, uncached prompt kilotokens (the prompt minus the prefix scorer's
match on that endpoint), waiting (+ picks not yet scraped), running, KV use, prefill
kilotokens in flight (the EPP's requests routed there without a first token yet) and
sequences decoding. TPOT features: 1, running, waiting, KV use, prefill kilotokens in
flight, decode kilotokens in flight (the predicted outputs still to generate), and the
rate of uncached prompt tokens the EPP has been sending there (kilotokens/s, decayed over
`RATE_TAU_S`): with chunked prefill, prompts that arrive while a request decodes share its
steps, so the recent prefill rate predicts the stalls ahead. The endpoint's role selects
the model (see `predictor.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pool.endpoints import Endpoint

import math

TTFT_DIM = 7
TPOT_DIM = 7
RATE_TAU_S = 2.0


@dataclass(slots=True)
class EndpointLoad:
    """The EPP's own requests on one endpoint, as it routed and observed them."""

    prefill_tokens: float = 0.0   # uncached prompt tokens routed there, no first token yet
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


def ttft_features(ep: Endpoint, load: EndpointLoad, uncached: float) -> list[float]:
    return [1.0, uncached / 1000.0, ep.waiting + ep.pending, ep.running, ep.kv_usage,
            load.prefill_tokens / 1000.0, float(load.decoding)]


def tpot_features(ep: Endpoint, load: EndpointLoad, now: float) -> list[float]:
    return [1.0, ep.running, ep.waiting + ep.pending, ep.kv_usage,
            load.prefill_tokens / 1000.0, load.decode_tokens / 1000.0, load.rate(now) / 1000.0]
