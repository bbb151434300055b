"""vLLM's `guided_regex`: the whole output matches a regular expression.

The pattern is parsed into a Thompson NFA; the state is the set of NFA states the
output so far can be in, stepped one character at a time, behind the same
constraint interface as JSON mode (constraint.TokenConstraint). Every NFA state
can reach the accepting one, so a live state never strands the model. The end of
sequence is allowed wherever the output matches; the request finishes by itself
once it matches and nothing longer could.

Supported: literals and escapes, `.` (not a newline), classes `[a-z_]`, `[^...]`,
`\\d \\w \\s` and their negations, groups `( )` and `(?: )`, `|`, `* + ?`,
`{m}`, `{m,}`, `{m,n}` (n <= MAX_REPEAT), lazy forms (same language), and `^`/`$`
at the ends (the match is always whole). Refused (RegexError -> 400):
backreferences, lookarounds, other `(?...)` groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

MAX_REPEAT = 256
MAX_STATES = 20000
_CLASSES = {"d": [("0", "9")], "w": [("a", "z"), ("A", "Z"), ("0", "9"), ("_", "_")],
            "s": [(c, c) for c in " \t\n\r\f\v"]}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


class RegexError(ValueError):
    """A pattern this automaton cannot enforce, or a malformed one."""


@dataclass(frozen=True, slots=True)
class CharSet:
    ranges: tuple          # ((lo, hi), ...) inclusive
    negated: bool = False

    def __contains__(self, ch: str) -> bool:
        inside = any(lo <= ch <= hi for lo, hi in self.ranges)
        return inside != self.negated


_ANY = CharSet((("\n", "\n"),), negated=True)


class _Nfa:
    def __init__(self) -> None:
        self.edges: list[list] = []   # per state: [(CharSet, next)]
        self.eps: list[list] = []     # per state: [next]

    def new(self) -> int:
        if len(self.edges) >= MAX_STATES:
            raise RegexError(f"pattern too large (more than {MAX_STATES} states)")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def clone(self, lo: int, hi: int, frag: tuple[int, int]) -> tuple[int, int]:
        """A copy of the fragment made of states lo..hi-1, which point only at each
        other (so far): renumbered, not re-parsed."""
        if len(self.edges) + hi - lo > MAX_STATES:
            raise RegexError(f"pattern too large (more than {MAX_STATES} states)")
        off = len(self.edges) - lo
        for i in range(lo, hi):
            self.edges.append([(cs, n + off) for cs, n in self.edges[i]])
            self.eps.append([n + off for n in self.eps[i]])
        return frag[0] + off, frag[1] + off


class _Parser:
    """Recursive descent; each parse_* returns a fragment (start, end) of the NFA."""

    def __init__(self, pattern: str, nfa: _Nfa) -> None:
        self.p, self.i, self.nfa = pattern, 0, nfa

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        ch = self.p[self.i]
        self.i += 1
        return ch

    def alternation(self) -> tuple[int, int]:
        frags = [self.concat()]
        while self.peek() == "|":
            self.take()
            frags.append(self.concat())
        if len(frags) == 1:
            return frags[0]
        s, e = self.nfa.new(), self.nfa.new()
        for a, b in frags:
            self.nfa.eps[s].append(a)
            self.nfa.eps[b].append(e)
        return s, e

    def concat(self) -> tuple[int, int]:
        s = e = self.nfa.new()
        while self.peek() not in (None, "|", ")"):
            a, b = self.repeat()
            self.nfa.eps[e].append(a)
            e = b
        return s, e

    def repeat(self) -> tuple[int, int]:
        first = len(self.nfa.edges)
        frag = self.atom()
        states = (first, len(self.nfa.edges))
        if self.peek() in ("*", "+", "?", "{"):
            lo, hi = self.quantifier()
            if self.peek() == "?":  # lazy: the same language
                self.take()
            if self.peek() in ("*", "+", "?", "{"):
                raise RegexError(f"multiple repeat at {self.i}: group the inner one")
            frag = self.repeated(frag, lo, hi, states)
        return frag

    def quantifier(self) -> tuple[int, int | None]:
        q = self.take()
        if q == "*":
            return 0, None
        if q == "+":
            return 1, None
        if q == "?":
            return 0, 1
        close = self.p.find("}", self.i)
        body = self.p[self.i:close] if close >= 0 else ""
        parts = body.split(",")
        try:
            lo = int(parts[0])
            hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        except ValueError:
            raise RegexError(f"bad repetition {{{body}}}") from None
        if len(parts) > 2 or lo < 0 or hi is not None and (hi < lo or hi > MAX_REPEAT) or lo > MAX_REPEAT:
            raise RegexError(f"repetition {{{body}}} must have 0 <= m <= n <= {MAX_REPEAT}")
        self.i = close + 1
        return lo, hi

    def repeated(self, frag, lo: int, hi: int | None, states: tuple[int, int]) -> tuple[int, int]:
        """frag{lo,hi}: every copy is cloned before any is wired (then frag points outside
        its states); with no upper bound, copy `lo` is the loop."""
        copies = [frag] + [self.nfa.clone(*states, frag)
                           for _ in range((lo + 1 if hi is None else max(hi, 1)) - 1)]
        s = e = self.nfa.new()
        for k in range(lo):
            a, b = copies[k]
            self.nfa.eps[e].append(a)
            e = b
        if hi is None:  # then any number more: a loop over one more copy
            a, b = copies[lo]
            self.nfa.eps[e].append(a)
            self.nfa.eps[b].append(a)
            out = self.nfa.new()
            self.nfa.eps[e].append(out)
            self.nfa.eps[b].append(out)
            return s, out
        out = self.nfa.new()
        self.nfa.eps[e].append(out)
        for k in range(lo, hi):  # optional copies, each may end the run
            a, b = copies[k]
            self.nfa.eps[e].append(a)
            self.nfa.eps[b].append(out)
            e = b
        return s, out

    def atom(self) -> tuple[int, int]:
        ch = self.take()
        if ch == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise RegexError("lookarounds and other (?...) groups are not supported")
            frag = self.alternation()
            if self.peek() != ")":
                raise RegexError("missing )")
            self.take()
            return frag
        if ch in "*+?{":
            raise RegexError(f"nothing to repeat before {ch!r} at {self.i - 1}")
        if ch == ")":
            raise RegexError(f"unbalanced ) at {self.i - 1}")
        if ch == "[":
            return self.char(self.bracket())
        if ch == ".":
            return self.char(_ANY)
        if ch in "^$" and (self.i == 1 or self.i == len(self.p)):
            s = self.nfa.new()
            return s, s
        if ch == "\\":
            return self.char(self.escape(in_class=False))
        return self.char(CharSet(((ch, ch),)))

    def char(self, cs: CharSet) -> tuple[int, int]:
        s, e = self.nfa.new(), self.nfa.new()
        self.nfa.edges[s].append((cs, e))
        return s, e

    def escape(self, in_class: bool) -> CharSet:
        if self.peek() is None:
            raise RegexError("pattern ends with \\")
        c = self.take()
        if c.lower() in _CLASSES:
            return CharSet(tuple(_CLASSES[c.lower()]), negated=c.isupper())
        if c.isdigit() or c in "bBAZzkgpP" and not in_class:
            raise RegexError(f"\\{c} (backreferences, word boundaries, ...) is not supported")
        c = _ESCAPES.get(c, c)
        return CharSet(((c, c),))

    def bracket(self) -> CharSet:
        negated = self.peek() == "^"
        if negated:
            self.take()
        ranges: list = []
        first = True
        while True:
            if self.peek() is None:
                raise RegexError("missing ]")
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                cs = self.escape(in_class=True)
                if cs.negated:
                    raise RegexError("negated classes inside [...] are not supported")
                ranges.extend(cs.ranges)
                continue
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.take()
                hi = self.take()
                if hi == "\\":
                    hi = self.escape(in_class=True).ranges[0][0]
                if hi < c:
                    raise RegexError(f"bad range {c}-{hi}")
                ranges.append((c, hi))
            else:
                ranges.append((c, c))
        return CharSet(tuple(ranges), negated)


@dataclass(frozen=True, slots=True)
class Regex:
    nfa: _Nfa
    start: int
    accept: int

    def closure(self, states) -> frozenset:
        seen = set(states)
        stack = list(states)
        while stack:
            for n in self.nfa.eps[stack.pop()]:
                if n not in seen:
                    seen.add(n)
                    stack.append(n)
        return frozenset(seen)


@lru_cache(maxsize=32)
def compile_regex(pattern: str) -> Regex:
    """The pattern's NFA, compiled once: the server's validation and the engine thread's
    add_request get the same (read-only) object, so the engine never compiles it."""
    if not isinstance(pattern, str) or not pattern:
        raise RegexError("the pattern must be a non-empty string")
    nfa = _Nfa()
    parser = _Parser(pattern, nfa)
    s, e = parser.alternation()
    if parser.i != len(pattern):
        raise RegexError(f"unbalanced ) at {parser.i}")
    return Regex(nfa, s, e)


@dataclass(frozen=True, slots=True)
class RegexState:
    """The NFA states the output so far can be in (epsilon-closed)."""

    regex: Regex
    states: frozenset

    @classmethod
    def start(cls, regex: Regex) -> "RegexState":
        return cls(regex, regex.closure([regex.start]))

    @property
    def ends_here(self) -> bool:
        return self.regex.accept in self.states

    @property
    def complete(self) -> bool:
        edges = self.regex.nfa.edges
        return self.ends_here and not any(edges[s] for s in self.states)

    def feed(self, text: str) -> "RegexState | None":
        states, edges = self.states, self.regex.nfa.edges
        for ch in text:
            nxt = [n for s in states for cs, n in edges[s] if ch in cs]
            if not nxt:
                return None
            states = self.regex.closure(nxt)
        return RegexState(self.regex, states)
