"""Blocks the EPP expects an endpoint to hold because it just sent it the prompt.

Between a pick and the worker's first `BlockStored` for it there is a prefill's worth
of time; without these entries a burst of one prefix would be spread over the pool
before any event says where it went. Each entry lives `ttl` seconds (llm-d: 2 s);
events confirm or contradict it well before then.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Speculative:
    ttl: float = 2.0
    entries: dict[int, dict[str, float]] = field(default_factory=dict)  # key -> addr -> expiry
    # (expiry, keys, addr) per `add`, oldest first: one record per pick, not per block (a
    # 100k-token prompt is ~6k blocks; per-block records made `add` cost more than scoring)
    _order: deque = field(default_factory=deque)

    def add(self, keys: list[int], addr: str, expiry: float) -> None:
        entries = self.entries
        fresh = []
        for k in keys:
            d = entries.get(k)
            if d is None:
                entries[k] = {addr: expiry}
                fresh.append(k)
            elif d.get(addr, 0.0) < expiry:
                d[addr] = expiry
                fresh.append(k)
        if fresh:
            self._order.append((expiry, fresh, addr))

    def holders(self, key: int, now: float) -> dict[str, float] | None:
        d = self.entries.get(key)
        if d is None:
            return None
        for exp in d.values():
            if exp <= now:
                break
        else:
            return d or None  # nothing expired: no copy of the addresses
        for addr in [a for a, exp in d.items() if exp <= now]:
            del d[addr]
        if not d:
            del self.entries[key]
            return None
        return d

    def confirm(self, key: int, addr: str) -> None:
        """The events say `addr` holds `key`: the guess is no longer needed."""
        d = self.entries.get(key)
        if d is not None:
            d.pop(addr, None)

    def purge(self, now: float) -> None:
        order, entries = self._order, self.entries
        while order and order[0][0] <= now:
            exp, keys, addr = order.popleft()
            for k in keys:
                d = entries.get(k)
                if d is None:
                    continue
                if d.get(addr) == exp:
                    del d[addr]
                if not d:  # emptied here, or by `confirm`
                    del entries[k]

    def forget(self, addr: str) -> None:
        for k in [k for k, d in self.entries.items() if d.pop(addr, None) is not None and not d]:
            del self.entries[k]

    def __len__(self) -> int:
        return len(self.entries)
