"""Per-request scheduling state that plugins share (GAIE's CycleState).

Producers write what they computed (the prefix scorer: matched blocks per
endpoint); later plugins and hooks read it (the decision's prefix-hit count,
the P/D decider's uncached tokens) without fields on the request object or
type checks on who computed it. One per scheduling cycle, never shared.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Well-known keys: "<producer>/<what>".
PREFIX_MATCHES = "prefix-cache/matched-blocks"  # dict[address, matched leading blocks]
# The P/D decider wanted a prefill pod and the pool had none (a prefill pool at zero):
# flow control tells the scaler, and the decode pod prefills this one itself.
PREFILL_MISSED = "disagg/prefill-missed"


@dataclass(slots=True)
class CycleState:
    data: dict[str, Any] = field(default_factory=dict)

    def write(self, key: str, value: Any) -> None:
        self.data[key] = value

    def read(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)
