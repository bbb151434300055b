"""Demand the EPP holds back: what flow control writes and the KEDA scaler reads.

Flow control (`controller.py`) counts the requests it holds, by the role of
endpoint they wait for, and calls `notify(role)` when a request reaches a role
with no ready endpoint (the waiting room). The scaler (`scaler/server.py`) reads the
counts for its metrics and subscribes to the notifications for
`StreamIsActive`, so a wake-up starts the moment the request arrives instead of
at KEDA's next poll. Roles here are the roles a request waits for:
`decode` (an endpoint that serves the request: role `decode` or `both`) and
`prefill` (nothing waits for one: a request the P/D decider would send to a
prefill pod when there is none is served decode-only, and only notifies
`prefill`, so a prefill pool at zero wakes). Listeners run on the event loop
and must not block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

WAIT_ROLES = ("decode", "prefill")


@dataclass(slots=True)
class Demand:
    parked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WAIT_ROLES, 0))
    parked_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WAIT_ROLES, 0))
    queued: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WAIT_ROLES, 0))
    queued_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WAIT_ROLES, 0))
    _listeners: list[Callable[[str], None]] = field(default_factory=list)

    def waiting(self, role: str) -> int:
        """Requests held for `role`: parked (no ready endpoint) plus queued (saturated)."""
        return self.parked.get(role, 0) + self.queued.get(role, 0)

    def subscribe(self, cb: Callable[[str], None]) -> Callable[[], None]:
        """Call `cb(role)` on every arrival at an empty role; returns the unsubscriber."""
        self._listeners.append(cb)
        return lambda: self._listeners.remove(cb) if cb in self._listeners else None

    def notify(self, role: str) -> None:
        for cb in list(self._listeners):
            cb(role)
