"""Approximate prefix-cache index: which blocks each endpoint probably holds.

Fed only by our own routing decisions (a request's blocks are assumed cached
where we sent it), bounded per endpoint by an LRU like the engine's own
eviction. Because block hashes are chained, a prefix match is "walk the
request's hashes until the first miss", O(matched blocks) per endpoint.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..prompt import LazyPrompt


@dataclass(slots=True)
class PrefixIndex:
    capacity: int = 31_250  # blocks per endpoint
    _lru: dict[str, OrderedDict] = field(default_factory=dict)

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
        over = len(d) - self.capacity
        for _ in range(max(0, over)):
            d.popitem(last=False)

    def remove(self, address: str) -> None:
        self._lru.pop(address, None)

    def size(self, address: str) -> int:
        return len(self._lru.get(address, ()))
