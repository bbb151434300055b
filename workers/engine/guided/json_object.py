"""JSON mode (`response_format: {"type": "json_object"}`): the output is one JSON object.

A character-level pushdown automaton over RFC 8259 says whether a text can still
grow into a valid document; a candidate token is allowed when its text keeps
the output a valid prefix. Sampling checks candidates in order of probability
(sampler.py), so a step tests a handful of tokens, not the whole vocabulary;
the request finishes ("stop") the moment the top-level object closes.

Decisions: the top level must be an object (OpenAI's json_object contract);
runs of whitespace outside strings are capped at MAX_WS characters, so a model
cannot pad forever; tokens whose text is empty (special tokens, EOS) are never
allowed before the object is complete. Token texts are what each id adds after
other text (`ChatTokenizer.token_text`: SentencePiece's leading spaces kept);
bytes of a partial UTF-8 character decode to U+FFFD, valid inside a string.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_WS = 24
_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
# number sub-states: where we are in -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?
_N_SIGN, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_DONE_OK = {_N_ZERO, _N_INT, _N_FRAC, _N_EXP}


@dataclass(slots=True)
class JsonState:
    """Where a JSON text stands. `mode` is what may come next; `stack` holds the open
    containers ('{' or '['); `sub` is the mode's detail (string escape progress, number
    sub-state, literal remainder, or whether the string is a key)."""

    stack: tuple[str, ...] = ()
    mode: str = "start"
    sub: object = None
    ws: int = 0

    @property
    def complete(self) -> bool:
        return self.mode == "done"

    ends_here = False  # the end of sequence never ends a JSON text: its closing does

    def feed(self, text: str) -> "JsonState | None":
        """The state after `text`, or None if no valid document starts with it."""
        st = JsonState(self.stack, self.mode, self.sub, self.ws)
        for ch in text:
            if not st._step(ch):
                return None
        return st

    # -- one character ---------------------------------------------------------------
    def _step(self, ch: str) -> bool:
        m = self.mode
        if m == "string":
            return self._string(ch)
        if m == "number":
            if self._number(ch):
                return True
            if self.sub not in _N_DONE_OK:
                return False
            self._value_done()          # the number ended here: ch belongs to what follows
            return self._step(ch)
        if m == "literal":
            rest = self.sub
            if ch != rest[0]:
                return False
            if len(rest) == 1:
                self._value_done()
            else:
                self.sub = rest[1:]
            return True
        if ch in _WS:
            if m == "done" or self.ws >= MAX_WS:
                return False
            self.ws += 1
            return True
        self.ws = 0
        if m == "start":
            return self._open(ch) if ch == "{" else False
        if m in ("value", "value_or_end"):
            if m == "value_or_end" and ch == "]":
                return self._close("[")
            return self._value(ch)
        if m in ("key", "key_or_end"):
            if m == "key_or_end" and ch == "}":
                return self._close("{")
            if ch == '"':
                self.mode, self.sub = "string", ("key", 0)
                return True
            return False
        if m == "colon":
            if ch == ":":
                self.mode = "value"
                return True
            return False
        if m == "next":
            top = self.stack[-1]
            if ch == ",":
                self.mode = "key" if top == "{" else "value"
                return True
            return self._close(top) if ch == ("}" if top == "{" else "]") else False
        return False                    # done: nothing may follow

    def _value(self, ch: str) -> bool:
        if ch in "{[":
            return self._open(ch)
        if ch == '"':
            self.mode, self.sub = "string", ("value", 0)
            return True
        if ch == "-" or ch.isdigit() and ch.isascii():
            self.mode = "number"
            self.sub = _N_SIGN if ch == "-" else _N_ZERO if ch == "0" else _N_INT
            return True
        for lit in ("true", "false", "null"):
            if ch == lit[0]:
                self.mode, self.sub = "literal", lit[1:]
                return True
        return False

    def _open(self, ch: str) -> bool:
        self.stack = self.stack + (ch,)
        self.mode = "key_or_end" if ch == "{" else "value_or_end"
        return True

    def _close(self, opener: str) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack = self.stack[:-1]
        self._value_done()
        return True

    def _value_done(self) -> None:
        self.mode = "next" if self.stack else "done"
        self.sub = None

    def _string(self, ch: str) -> bool:
        kind, esc = self.sub             # esc: 0 plain, 1 after '\', 2..5 hex digits of \u
        if esc == 1:
            if ch == "u":
                self.sub = (kind, 2)
                return True
            if ch in _ESCAPES:
                self.sub = (kind, 0)
                return True
            return False
        if esc >= 2:
            if ch not in _HEX:
                return False
            self.sub = (kind, esc + 1 if esc < 5 else 0)
            return True
        if ch == "\\":
            self.sub = (kind, 1)
            return True
        if ch == '"':
            if kind == "key":
                self.mode, self.sub = "colon", None
            else:
                self._value_done()
            return True
        return ord(ch) >= 0x20

    def _number(self, ch: str) -> bool:
        nxt = number_step(self.sub, ch)
        if nxt is None:
            return False
        self.sub = nxt
        return True


def number_step(s: int, ch: str, integer: bool = False) -> int | None:
    """The number sub-state after `ch`, or None if `ch` does not continue the number
    (`integer`: no fraction, no exponent)."""
    digit = ch.isdigit() and ch.isascii()
    if s == _N_SIGN:
        return _N_ZERO if ch == "0" else _N_INT if digit else None
    if s in (_N_ZERO, _N_INT):
        if digit and s == _N_INT:
            return _N_INT
        if integer:
            return None
        return _N_DOT if ch == "." else _N_E if ch in "eE" else None
    if s in (_N_DOT, _N_FRAC):
        return _N_FRAC if digit else _N_E if s == _N_FRAC and ch in "eE" else None
    if s == _N_E:
        return _N_ESIGN if ch in "+-" else _N_EXP if digit else None
    return _N_EXP if digit else None  # _N_ESIGN, _N_EXP
