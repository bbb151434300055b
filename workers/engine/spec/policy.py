"""When to speculate: per request from its own acceptance, per step from what a token costs.

A draft token costs target compute whether it is accepted or not. Adding a draft of k
tokens to a row of a step that now computes T tokens and emits N costs k more tokens'
worth of step time and emits rho * k more tokens on average (rho: the request's recent
share of draft tokens accepted). With a step costing a + b * T (a: reading the weights
and fixed overheads, b: a token's compute), the draft raises the step's tokens per
second iff rho * (a + b * T) > N * b. `StepCost` fits a and b online from the engine's
own decode and verify steps (an exponentially weighted least-squares line), so the rule
adapts to the device and the batch: at batch 1 on a GPU (a >> b) almost any acceptance
pays; at batch 8 on a CPU it takes a repetitive text. Rows are added best rho first
until the next one would not pay (`choose`).

Under `policy: auto` a request the rule turns down `pause_steps` steps in a row drafts
once anyway (a probe: its rho follows its text), and one whose acceptance falls below
`min_acceptance` after `min_drafts` drafts is paused for `pause_steps` steps (no proposals
at all), then probed. `always` drafts whenever
the proposer has something.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import SpeculativeConfig

PRIOR_RHO = 0.5        # a request's acceptance before its first draft
RHO_DECAY = 0.7        # weight of the past in a request's acceptance estimate
COST_DECAY = 0.98      # weight of the past in the step-cost fit (per observed step)


@dataclass(slots=True)
class SpecState:
    """One request's speculation bookkeeping (on `Sequence.spec`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    rho: float = PRIOR_RHO       # recent share of its draft tokens accepted
    paused_for: int = 0          # plain decode steps left before the next probe
    probe: bool = False          # a pause just ended: draft once to refresh rho
    skipped: int = 0             # steps in a row the cost rule turned its draft down
    draft_computed: int = 0      # draft model: leading tokens whose draft KV is valid
    preemptions: int = 0         # the request's preemption count the draft KV belongs to


@dataclass(slots=True)
class StepCost:
    """Step time ~ a + b * tokens, fitted by exponentially weighted least squares."""

    w: float = 0.0
    st: float = 0.0
    sd: float = 0.0
    stt: float = 0.0
    std: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = COST_DECAY
        self.w = d * self.w + 1.0
        self.st = d * self.st + tokens
        self.sd = d * self.sd + seconds
        self.stt = d * self.stt + tokens * tokens
        self.std = d * self.std + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None until the steps seen vary enough in size to tell."""
        if self.w < 4:
            return None
        mt, md = self.st / self.w, self.sd / self.w
        var = self.stt / self.w - mt * mt
        if var < 0.5:
            return None
        b = max(0.0, (self.std / self.w - mt * md) / var)
        return max(md - b * mt, 1e-9), b


class SpecPolicy:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.auto = cfg.policy == "auto"
        self.min_acceptance = cfg.min_acceptance
        self.pause_steps = cfg.pause_steps
        self.min_drafts = cfg.min_drafts
        self.cost = StepCost()

    def wants_draft(self, st: SpecState) -> bool:
        if st.paused_for > 0:
            st.paused_for -= 1
            st.probe = st.paused_for == 0    # the next step drafts, whatever the rule says
            return False
        return True

    def choose(self, rows: list[tuple[Any, int]], tokens: int, emitted: int) -> list[tuple[Any, int]]:
        """The (sequence, k) rows worth drafting in a step that computes `tokens` and
        emits `emitted` without drafts; the others are paused (auto) until a probe."""
        if not self.auto or not rows:
            return rows
        line = self.cost.line()
        if line is None:
            return rows                      # no fit yet: drafting also teaches it
        a, b = line
        kept: list[tuple[Any, int]] = []
        for seq, k in sorted(rows, key=lambda r: -r[0].spec.rho):
            rho = seq.spec.rho
            st = seq.spec
            if st.probe or rho * (a + b * tokens) > emitted * b:
                st.probe, st.skipped = False, 0
                kept.append((seq, k))
                tokens += k
                emitted += rho * k
            else:   # the rule is the batch's: asked again next step, probed now and then
                st.skipped += 1
                st.probe = st.skipped >= self.pause_steps
        return kept

    def record(self, st: SpecState, proposed: int, accepted: int) -> None:
        st.drafts += 1
        st.draft_tokens += proposed
        st.accepted += accepted
        st.rho = RHO_DECAY * st.rho + (1 - RHO_DECAY) * accepted / proposed
        if self.auto and st.drafts >= self.min_drafts \
                and st.accepted < self.min_acceptance * st.draft_tokens:
            st.paused_for = self.pause_steps
            st.drafts = st.draft_tokens = st.accepted = 0   # the next probe starts afresh
