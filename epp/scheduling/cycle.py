"""Per-request scheduling state that plugins share (GAIE's CycleState), with typed keys.

Producers write what they computed (the prefix scorer: matched blocks per
endpoint); later plugins and hooks read it (the decision's prefix-hit count,
the P/D decider's uncached tokens) without fields on the request object or
type checks on who computed it. One per scheduling cycle, never shared.

A key is a `StateKey[T]` object, declared once by its producer: the value's
type travels with the key (a type checker sees `read(PREFIX_MATCHES)` as a
`dict[str, int] | None`), and a misspelt key is a NameError at import instead
of a silent miss. Keys hash by identity, so a lookup costs one dict probe.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


@dataclass(slots=True, frozen=True, eq=False)
class StateKey(Generic[T]):
    name: str  # "<producer>/<what>", for debugging

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


# Matched leading blocks per endpoint address (the prefix-cache scorer writes it).
PREFIX_MATCHES: StateKey[dict[str, int]] = StateKey("prefix-cache/matched-blocks")
# The P/D decider wanted a prefill pod and the pool had none (a prefill pool at zero):
# flow control tells the scaler, and the decode pod prefills this one itself.
PREFILL_MISSED: StateKey[bool] = StateKey("disagg/prefill-missed")


@dataclass(slots=True)
class CycleState:
    data: dict[StateKey[Any], Any] = field(default_factory=dict)

    def write(self, key: StateKey[T], value: T) -> None:
        self.data[key] = value

    @overload
    def read(self, key: StateKey[T]) -> T | None: ...

    @overload
    def read(self, key: StateKey[T], default: T) -> T: ...

    def read(self, key: StateKey[T], default: T | None = None) -> T | None:
        return self.data.get(key, default)
