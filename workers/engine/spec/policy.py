"""When to speculate: per request, from its own acceptance.

A draft costs target compute whether it is accepted or not, so a request whose drafts
are mostly rejected (creative text under n-gram lookup, a draft model that disagrees)
decodes slower with speculation than without. Under `policy: auto` a request that has
seen `min_drafts` drafts and accepts less than `min_acceptance` of its draft tokens is
paused: it decodes plainly for `pause_steps` steps, then is probed again with a fresh
count, so a request whose text turns repetitive later gets speculation back. `always`
drafts whenever the proposer has something.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import SpeculativeConfig


@dataclass(slots=True)
class SpecState:
    """One request's speculation bookkeeping (on `Sequence.spec`)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    paused_for: int = 0          # plain decode steps left before the next probe
    draft_computed: int = 0      # draft model: leading tokens whose draft KV is valid
    preemptions: int = 0         # the request's preemption count the draft KV belongs to


class SpecPolicy:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.auto = cfg.policy == "auto"
        self.min_acceptance = cfg.min_acceptance
        self.pause_steps = cfg.pause_steps
        self.min_drafts = cfg.min_drafts

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
