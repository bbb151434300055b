"""What a latency prediction reads: the endpoint's scraped state, the EPP's own
requests in flight on it, and the request's uncached prompt tokens there.

TTFT features: 1, uncached prompt kilotokens (the prompt minus the prefix scorer's
match on that endpoint), waiting (+ picks not yet scraped), running, KV use, prefill
kilotokens in flight (the EPP's requests routed there without a first token yet) and
sequences decoding. TPOT features: 1, running, waiting, KV use, prefill kilotokens in
flight, decode kilotokens in flight (the predicted outputs still to generate). The
endpoint's role selects the model (see `predictor.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pool.endpoints import Endpoint

TTFT_DIM = 7
TPOT_DIM = 6


@dataclass(slots=True)
class EndpointLoad:
    """The EPP's own requests on one endpoint, as it routed and observed them."""

    prefill_tokens: float = 0.0   # uncached prompt tokens routed there, no first token yet
    decoding: int = 0             # requests past their first token, not finished
    decode_tokens: float = 0.0    # their predicted output tokens still to come


def ttft_features(ep: Endpoint, load: EndpointLoad, uncached: float) -> list[float]:
    return [1.0, uncached / 1000.0, ep.waiting + ep.pending, ep.running, ep.kv_usage,
            load.prefill_tokens / 1000.0, float(load.decoding)]


def tpot_features(ep: Endpoint, load: EndpointLoad) -> list[float]:
    return [1.0, ep.running, ep.waiting + ep.pending, ep.kv_usage,
            load.prefill_tokens / 1000.0, load.decode_tokens / 1000.0]
