"""When to speculate: per step from measured throughput, per request from its acceptance.

A draft costs target compute whether it is accepted or not, and what a token of compute
costs depends on the device, the batch and the machine's load: on a GPU at batch 1 a
verify step costs about what a decode step does; on a CPU at batch 8 it can cost several
times more. So under `policy: auto` the engine measures instead of modelling:
`BatchGate` keeps, per batch size (decode rows, in powers of two), the recent output
tokens per second of steps that verified drafts and of steps that did not, and lets a
step draft only when drafting has been the faster of the two; every `EXPLORE` steps it
tries the other arm, so both estimates follow the workload. A request whose acceptance
falls below `min_acceptance` after `min_drafts` drafts is paused for `pause_steps` steps
(no proposals at all), then probed again. `always` drafts whenever the proposer has
something.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import SpeculativeConfig

RATE_DECAY = 0.9   # weight of the past in an arm's tokens/s (about the last ten steps)
MIN_STEPS = 3      # steps an arm needs before its rate counts
EXPLORE = 16       # every this many steps of a batch size, the other arm runs once


@dataclass(slots=True)
class SpecState:
    """One request's speculation bookkeeping (on `Sequence.spec`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    paused_for: int = 0          # plain decode steps left before the next probe
    draft_computed: int = 0      # draft model: leading tokens whose draft KV is valid
    preemptions: int = 0         # the request's preemption count the draft KV belongs to


@dataclass(slots=True)
class _Arm:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = RATE_DECAY * self.tokens + tokens
        self.seconds = RATE_DECAY * self.seconds + seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class BatchGate:
    """Per batch size: tokens/s of decode steps with drafts vs without; which to run next."""

    arms: dict[tuple[int, bool], _Arm] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def allow(self, rows: int) -> bool:
        b = self.bucket(rows)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        spec, plain = self.arms.get((b, True)), self.arms.get((b, False))
        if spec is None or spec.steps < MIN_STEPS:
            return True                     # learn what drafting gives first
        if plain is None or plain.steps < MIN_STEPS:
            return n % 2 == 0               # plain steps come anyway where nothing matches
        better = spec.rate >= plain.rate
        return (not better) if n % EXPLORE == 0 else better

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        self.arms.setdefault((self.bucket(rows), drafted), _Arm()).add(tokens, seconds)


class SpecPolicy:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.auto = cfg.policy == "auto"
        self.min_acceptance = cfg.min_acceptance
        self.pause_steps = cfg.pause_steps
        self.min_drafts = cfg.min_drafts
        self.gate = BatchGate()

    def step_allows(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows may draft (always outside auto)."""
        return not self.auto or self.gate.allow(rows)

    def wants_draft(self, st: SpecState) -> bool:
        if st.paused_for > 0:
            st.paused_for -= 1
            return False
        return True

    def record(self, st: SpecState, proposed: int, accepted: int) -> None:
        st.drafts += 1
        st.draft_tokens += proposed
        st.accepted += accepted
        if self.auto and st.drafts >= self.min_drafts \
                and st.accepted < self.min_acceptance * st.draft_tokens:
            st.paused_for = self.pause_steps
            st.drafts = st.draft_tokens = st.accepted = 0   # the next probe starts afresh
