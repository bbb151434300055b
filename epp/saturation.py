"""Pool saturation, for shedding sheddable (priority < 0) requests.

Same rule as the reference EPP so operators can reason about both the same
way: a pod is saturated at 5 queued requests or 80 % KV usage, whichever comes
first; the pool is the mean. At ≥ 1 sheddable requests get 429 instead of
queueing behind critical ones.
"""
from __future__ import annotations

from typing import Sequence

from .pool.endpoints import Endpoint

QUEUE_LIMIT = 5.0
KV_LIMIT = 0.8


def pod_saturation(ep: Endpoint, picks: bool = True) -> float:
    """`picks`: count our picks not yet in a scrape as queued (shedding does, being
    cautious; holding does not: a burst is the workers' to batch, not ours to delay)."""
    queued = ep.waiting + (ep.pending if picks else 0)
    return max(queued / QUEUE_LIMIT, ep.kv_usage / KV_LIMIT)


def pool_saturation(endpoints: Sequence[Endpoint], picks: bool = True) -> float:
    if not endpoints:
        return 0.0
    return sum(pod_saturation(e, picks) for e in endpoints) / len(endpoints)
