"""Speculative decoding counters, vLLM's (exported by the server's metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]: drafts whose position i was accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per drafted step: 1 + accepted per draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
