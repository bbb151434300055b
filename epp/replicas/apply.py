"""A peer's pick applied as the local pick was: the scheduler's PreRequest state."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..pool.endpoints import EndpointPool
from ..scheduling.scheduler import Scheduler
from ..scheduling.scorers.precise_prefix import PrecisePrefixScorer
from ..scheduling.scorers.prefix_cache import PrefixCacheScorer
from .wire import Pick


@dataclass(slots=True)
class PickApplier:
    scheduler: Scheduler
    pool: EndpointPool

    def _plugins(self) -> list[object]:
        seen: dict[int, object] = {}
        for prof in self.scheduler.profiles.values():
            for p in prof.plugins():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def apply(self, picks: list[Pick], count: bool = True) -> int:
        """Applies `picks`; `count=False` (a snapshot) leaves the pending counts alone,
        which the scrape since those picks already reflects. Returns how many applied."""
        plugins = self._plugins()
        now, wall = time.monotonic(), time.time()
        n = 0
        for p in picks:
            ep = self.pool.get(p.address)
            if ep is None:  # not in this replica's pool (yet): nothing to credit
                continue
            n += 1
            if p.learned:  # as the finisher teaches a local pick's whole prompt
                self.scheduler.learn(p.address, p.hashes)
                continue
            age = max(0.0, wall - p.t)
            for pl in plugins:
                if isinstance(pl, PrecisePrefixScorer):
                    self._precise(pl, p, now, age)
                elif isinstance(pl, PrefixCacheScorer) and p.hashes:
                    pl.index.record(p.address, p.hashes)
            if count:
                ep.pending += 1
        return n

    @staticmethod
    def _precise(s: PrecisePrefixScorer, p: Pick, now: float, age: float) -> None:
        if p.address not in s.index.subscribed:
            if p.hashes:
                s.fallback.index.record(p.address, p.hashes)
            return
        ttl = s.speculative.ttl - age
        if ttl <= 0:
            return
        bs = s.index.block_size.get(p.address)
        keys = p.keys.get(bs) if bs is not None else None
        for k in ([keys] if keys is not None else p.keys.values()):
            s.speculative.add(k, p.address, now + ttl)
