"""Approximate prefix-cache index: which blocks each endpoint probably holds.

Fed only by our own routing decisions (a request's blocks are assumed cached
where we sent it), bounded per endpoint by an LRU like the engine's own
eviction, sized to the endpoint's real KV cache once its metrics say
(`vllm:cache_config_info`: block_size × num_gpu_blocks tokens, `set_capacity`);
`capacity` until then. An index that believes in more blocks than the pod
holds keeps routing to prefixes it evicted long ago. Because block hashes are chained, a prefix match is "walk the
request's hashes until the first miss", O(matched blocks) per endpoint.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..prompt import LazyPrompt


@dataclass(slots=True)
class PrefixIndex:
    capacity: int = 31_250  # blocks per endpoint, unless its own is known
    _lru: dict[str, OrderedDict] = field(default_factory=dict)
    _capacity: dict[str, int] = field(default_factory=dict)  # address -> its real capacity

    def set_capacity(self, address: str, blocks: int) -> None:
        """The endpoint's KV cache holds `blocks` of this index's blocks."""
        blocks = max(1, blocks)
        if self._capacity.get(address) != blocks:
            self._capacity[address] = blocks
            self._trim(address)

    def _trim(self, address: str) -> None:
        d = self._lru.get(address)
        if d is not None:
            for _ in range(max(0, len(d) - self._capacity.get(address, self.capacity))):
                d.popitem(last=False)

    def match(self, address: str, prompt: LazyPrompt) -> int:
        """Leading blocks of `prompt` that `address` holds; hashes further blocks
        of the prompt only while they keep matching."""
        d = self._lru.get(address)
        if not d:
            return 0
        n = 0
        hashes = prompt.hashes  # grows in place as the prompt is hashed further
        while True:
            while n < len(hashes):
                if hashes[n] not in d:
                    return n
                n += 1
            if prompt.get(n) is None:
                return n

    def record(self, address: str, hashes: list[int]) -> None:
        d = self._lru.get(address)
        if d is None:
            d = self._lru[address] = OrderedDict()
        for h in hashes:
            if h in d:
                d.move_to_end(h)
            else:
                d[h] = None
        self._trim(address)

    def remove(self, address: str) -> None:
        self._lru.pop(address, None)
        self._capacity.pop(address, None)

    def size(self, address: str) -> int:
        return len(self._lru.get(address, ()))
