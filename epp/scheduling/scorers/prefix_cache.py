"""The prefix-cache scorer: endpoints that probably hold the prompt's leading blocks."""
from __future__ import annotations

from dataclasses import dataclass

from ...pool.endpoints import Endpoint
from ..cycle import PREFIX_MATCHES
from ..hooks import PoolListener, PostResponse, PreRequest, Scorer
from ..plugin_config import param
from ..prefix_index import PrefixIndex
from ..types import SchedRequest


@dataclass(slots=True, frozen=True)
class PrefixCacheParams:
    lruCapacityPerServer: int = param(31_250, min=1,
                                      doc="block hashes remembered per endpoint (LRU) until its "
                                          "metrics give its KV-cache size")


@dataclass(slots=True)
class PrefixCacheScorer(Scorer, PreRequest, PostResponse, PoolListener):
    """Matched leading blocks / total blocks; learns from each pick, remembering per
    endpoint as many blocks as its KV cache holds (`vllm:cache_config_info`; else
    lruCapacityPerServer). Writes the matches per endpoint to the cycle state
    (`PREFIX_MATCHES`)."""

    index: PrefixIndex
    name: str = "prefix-cache"

    @classmethod
    def build(cls, p: PrefixCacheParams) -> "PrefixCacheScorer":
        return cls(PrefixIndex(p.lruCapacityPerServer))

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        matched = [self.index.match(e.address, req.prompt) for e in eps]
        total = max(req.prompt.estimated_blocks(), max(matched))
        if total == 0:
            return [0.0] * len(eps)
        seen = req.cycle.read(PREFIX_MATCHES)
        if seen is None:
            req.cycle.write(PREFIX_MATCHES, seen := {})
        seen.update((e.address, n) for e, n in zip(eps, matched))
        return [n / total for n in matched]

    def pre_request(self, req: SchedRequest, ep: Endpoint) -> None:
        if ep.block_size and ep.num_gpu_blocks:  # its real cache, from its metrics
            self.index.set_capacity(ep.address,
                                    ep.block_size * ep.num_gpu_blocks // req.prompt.block_size)
        # What is hashed so far; the rest arrives via `learn` after the answer.
        if req.prompt.hashes:
            self.index.record(ep.address, req.prompt.hashes)

    def learn(self, address: str, hashes: list[int]) -> None:
        if hashes:
            self.index.record(address, hashes)

    def forget(self, address: str) -> None:
        self.index.remove(address)
