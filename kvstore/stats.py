"""Per-tier counters, read by `KVStore.stats()` and the Prometheus collector."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TierStats:
    """Counters are monotonic; `bytes` is what the tier holds now (a gauge).

    Updated under each tier's own lock, so the numbers are exact; readers take
    a snapshot with `as_dict` and may see one tier a moment older than another.
    """

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    evictions: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
