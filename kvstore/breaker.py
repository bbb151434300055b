"""A circuit breaker so a dead remote tier costs nothing on the decode path.

After a failure the tier is skipped outright (no socket work) for a backoff
that doubles per consecutive failure up to a cap; when it elapses one caller
gets a trial call (half-open) while others keep skipping. A success closes it.

A named breaker logs its transitions, not its calls: one warning (the tier and
the error) when it opens, one info line when it closes again, however many
operations were skipped or trials failed in between, so a worker's log says
that Redis went away without saying it a thousand times a second.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvyard.kvstore")


class CircuitBreaker:
    def __init__(self, base_s: float = 0.5, max_s: float = 10.0, name: str | None = None) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.name = name
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
            failed = self.failures
            self.failures = 0
            self._trial = False
        if failed and self.name:
            log.info("kvstore tier %s is back (after %d failed attempt%s)", self.name, failed,
                     "" if failed == 1 else "s")

    def failure(self, error: BaseException | None = None) -> None:
        with self._lock:
            self.failures += 1
            self._trial = False
            backoff = min(self.max_s, self.base_s * 2 ** (self.failures - 1))
            self._open_until = time.monotonic() + backoff
            opened = self.failures == 1
        if opened and self.name:
            why = f"{type(error).__name__}: {error}" if error is not None else "failed"
            log.warning("kvstore tier %s is down (%s); skipping it, retrying every %g-%gs "
                        "(logged again when it is back)", self.name, why, self.base_s, self.max_s)
