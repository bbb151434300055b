"""The one interface the sampler calls for guided output, and its implementation.

Every guided mode is a character-level state with the same three members:
`feed(text)` (the state after `text`, None if no valid output starts so),
`complete` (the output is whole: the request stops) and `ends_here` (the end of
sequence is allowed now). `TokenConstraint` turns such a state into token
decisions with the tokenizer's token texts; the sampler (sampler.py) sees only
`Constraint`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .json_object import JsonState


class Constraint(Protocol):
    """What the sampler and the stop check ask of a guided request."""

    @property
    def complete(self) -> bool: ...
    def allows(self, token_id: int) -> bool: ...
    def prefilter(self, ids: np.ndarray) -> np.ndarray: ...
    def advance(self, token_id: int) -> None: ...


@dataclass(slots=True)
class TokenConstraint:
    """The `Constraint` of every guided mode: a request's state (json_object.JsonState,
    schema.SchemaState, choice.ChoiceState or regex.RegexState) plus the token
    texts it checks candidates with. Which first characters the state accepts is
    memoised until the next token: a scan over thousands of candidates (a schema that
    leaves the model one unlikely way on) then feeds most of them one character."""

    token_text: Callable[[int], str]
    state: Any = field(default_factory=JsonState)
    first_codes: Any = None  # numpy int32 [vocab]: each token's first code point, -1 none
    _first: dict = field(default_factory=dict)
    _last: tuple | None = None  # (token id, state after it) of the last full check passed

    @property
    def complete(self) -> bool:
        return self.state.complete

    def allows(self, token_id: int) -> bool:
        text = self.token_text(token_id)
        if not text:  # EOS, special tokens: only where the state may end (guided_choice)
            return self.state.ends_here
        ok = self._first.get(text[0])
        if ok is None:
            ok = self._first[text[0]] = self.state.feed(text[0]) is not None
        if not ok or len(text) == 1:
            return ok
        nxt = self.state.feed(text)
        if nxt is not None:  # the sampled token is usually the last one checked:
            self._last = (token_id, nxt)  # advance then takes this state, not a second feed
        return nxt is not None

    def prefilter(self, ids):
        """The positions in `ids` (numpy int64) whose first character the state accepts,
        in order: one vectorised pass where a scan would call `allows` on thousands of
        tokens (all of them without `first_codes`)."""
        if self.first_codes is None:
            return np.arange(len(ids))
        codes = self.first_codes[np.clip(ids, 0, len(self.first_codes) - 1)]
        ok = np.zeros(len(ids), dtype=bool)
        for code in np.unique(codes).tolist():
            ch = chr(code) if code >= 0 else ""
            good = self._first.get(ch)
            if good is None:
                good = self.state.ends_here if not ch else self.state.feed(ch) is not None
                self._first[ch] = good
            if good:
                ok |= codes == code
        return np.flatnonzero(ok)

    def advance(self, token_id: int) -> None:
        last = self._last
        nxt = last[1] if last is not None and last[0] == token_id \
            else self.state.feed(self.token_text(token_id))
        if nxt is None:
            raise ValueError(f"token {token_id} breaks the JSON output")
        self.state = nxt
        self._first = {}
        self._last = None
