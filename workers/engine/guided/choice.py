"""vLLM's `guided_choice`: the output is exactly one of the given strings.

Same constraint path as JSON mode (constraint.TokenConstraint): a token is allowed
when its text keeps the output a prefix of some choice. The request finishes when
the output equals a choice that no longer choice extends; when one does ("no" and
"none"), the end of sequence is allowed there and the model picks. Choices are
matched on text, so a choice whose characters the vocabulary only spells with
partial UTF-8 byte tokens cannot be produced (ASCII always can).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ChoiceState:
    """The unmatched rest of every choice the output is still a prefix of."""

    rests: frozenset

    @classmethod
    def start(cls, choices) -> "ChoiceState":
        return cls(frozenset(choices))

    @property
    def ends_here(self) -> bool:
        """The output is one of the choices (the end of sequence may come now)."""
        return "" in self.rests

    @property
    def complete(self) -> bool:
        """A choice is matched and none goes on: nothing else may come."""
        return self.rests == frozenset({""})

    def feed(self, text: str) -> "ChoiceState | None":
        rests = self.rests
        for ch in text:
            rests = frozenset(r[1:] for r in rests if r[:1] == ch)
            if not rests:
                return None
        return ChoiceState(rests)
