"""A circuit breaker so a dead remote tier costs nothing on the decode path.

After a failure the tier is skipped outright (no socket work) for a backoff
that doubles per consecutive failure up to a cap; when it elapses one caller
gets a trial call (half-open) while others keep skipping. A success closes it.
"""
from __future__ import annotations

import threading
import time


class CircuitBreaker:
    def __init__(self, base_s: float = 0.5, max_s: float = 10.0) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.failures = 0
        self._open_until = 0.0
        self._trial = False
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.failures > 0

    def ready(self) -> bool:
        """Whether a call would be attempted now, without claiming the trial."""
        with self._lock:
            return self.failures == 0 or (not self._trial and time.monotonic() >= self._open_until)

    def allow(self) -> bool:
        with self._lock:
            if self.failures == 0:
                return True
            if self._trial or time.monotonic() < self._open_until:
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            self._trial = False
            backoff = min(self.max_s, self.base_s * 2 ** (self.failures - 1))
            self._open_until = time.monotonic() + backoff
