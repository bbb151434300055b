"""When a request ends, and which text it may stream before it does.

Stop strings are matched on detokenized text, since a stop string can span
token boundaries or start mid-token. Text that might still turn out to be
the start of a stop string is held back, so a client never receives a
fragment that is later trimmed away.

All of a request's stop strings are one Aho-Corasick automaton, built once
where the request is validated (`StopStrings`); each sequence keeps its state
in it and steps it over each token's new text only, so the engine thread's
cost per token is linear in that text (amortized), whatever the number and
length of the stop strings. The text held back is the state's depth: the
longest tail of the output that is a prefix of some stop string.

Which match wins: the stop string that ends first in the output wins, and of
those ending at that character the longest; the output is cut at its start.
That is what a reader going character by character sees, so the outcome never
depends on how the text was split into tokens (stops "abcd" and "bc" on
"abcd" cut after "a", in one delta or four).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

from .sequence import Sequence

_LEAF, _CHAIN, _BRANCH = 0, 1, 2


@dataclass(slots=True)
class StopMatcher:
    """The automaton. Node 0 is the root; a node is a prefix of some stop string.

    Stop strings rarely share much, so most nodes have one child, numbered
    next: `label[v]` is the character into node v and `kind[u]` says whether u's
    only child is u + 1 (_CHAIN), or its children are in `branch[u]` (_BRANCH,
    at most one node per stop string), or it has none (_LEAF). That keeps a
    request at the cap (128 x 512 characters) near 1 MB instead of a dict per
    node."""

    label: str
    kind: bytearray
    branch: dict[int, dict[str, int]]
    fail: array           # the longest proper suffix of the node's text that is a node
    depth: array
    out: array            # length of the longest stop string ending at the node, 0 if none

    @classmethod
    def build(cls, stops: Iterable[str]) -> "StopMatcher":
        labels: list[str] = ["\0"]
        kind = bytearray(1)
        branch: dict[int, dict[str, int]] = {}
        depth = array("i", [0])
        ends: dict[int, int] = {}
        n = 1
        for s in sorted(set(s for s in stops if s)):
            u, d = 0, 0
            while d < len(s):            # walk the shared prefix
                v = cls._child(labels, kind, branch, u, s[d])
                if v < 0:
                    break
                u, d = v, d + 1
            if d < len(s):               # then the new tail, as one run of nodes
                if kind[u] == _LEAF and u == n - 1:
                    kind[u] = _CHAIN
                else:
                    if kind[u] != _BRANCH:
                        branch[u] = {} if kind[u] == _LEAF else {labels[u + 1]: u + 1}
                        kind[u] = _BRANCH
                    branch[u][s[d]] = n
                tail = len(s) - d
                labels.extend(s[d:])
                kind.extend(bytes([_CHAIN]) * (tail - 1) + bytes([_LEAF]))
                depth.extend(range(d + 1, len(s) + 1))
                u, n = n + tail - 1, n + tail
            ends[u] = len(s)
        m = cls("".join(labels), kind, branch, array("i"), depth, array("i"))
        m._link(ends)
        return m

    @staticmethod
    def _child(label: list[str], kind: bytearray, branch: dict, u: int, ch: str) -> int:
        k = kind[u]
        if k == _CHAIN:
            return u + 1 if label[u + 1] == ch else -1
        if k == _BRANCH:
            return branch[u].get(ch, -1)
        return -1

    def _children(self, u: int) -> Iterable[int]:
        k = self.kind[u]
        if k == _CHAIN:
            return (u + 1,)
        return self.branch[u].values() if k == _BRANCH else ()

    def _link(self, ends: dict[int, int]) -> None:
        """Failure and output links, breadth first (a node's links use shallower
        nodes'). The lookups are written out: this loop is most of a build's time."""
        label, kind, branch = self.label, self.kind, self.branch
        fail = [0] * len(kind)
        out = [0] * len(kind)
        for v, length in ends.items():
            out[v] = length
        level = list(self._children(0))
        while level:
            nxt: list[int] = []
            for u in level:
                k = kind[u]
                if k == _LEAF:
                    continue
                for v in ((u + 1,) if k == _CHAIN else branch[u].values()):
                    ch = label[v]
                    f = fail[u]
                    while True:
                        k = kind[f]
                        if k == _CHAIN:
                            if label[f + 1] == ch:
                                f += 1
                                break
                        elif k == _BRANCH:
                            w = branch[f].get(ch, -1)
                            if w >= 0:
                                f = w
                                break
                        if not f:
                            break
                        f = fail[f]
                    fail[v] = f
                    if not out[v]:
                        out[v] = out[f]
                    nxt.append(v)
            level = nxt
        self.fail, self.out = array("i", fail), array("i", out)

    def scan(self, state: int, text: str) -> tuple[int, int]:
        """Steps `state` over `text`: (new state, index in `text` just past the first
        character where a stop string ends, or -1). At a match the state is left there."""
        label, kind, branch, fail, out = self.label, self.kind, self.branch, self.fail, self.out
        for i, ch in enumerate(text):
            while True:
                k = kind[state]
                if k == _CHAIN:
                    if label[state + 1] == ch:
                        state += 1
                        break
                elif k == _BRANCH:
                    w = branch[state].get(ch, -1)
                    if w >= 0:
                        state = w
                        break
                if state == 0:
                    break
                state = fail[state]
            if out[state]:
                return state, i + 1
        return state, -1

    def open_depth(self, state: int) -> int:
        """Length of the longest tail of the text read to `state` that is a proper
        prefix of a stop string: the state's own unless no stop string extends it."""
        while state and self.kind[state] == _LEAF:
            state = self.fail[state]
        return self.depth[state]


class StopStrings(list):
    """A request's stop strings together with their automaton, so it is built once
    where the request is validated (and shared by its n choices), not per sequence
    on the engine thread. A plain list works too: it is compiled at first use."""

    __slots__ = ("matcher",)

    def __init__(self, stops: Iterable[str] = ()) -> None:
        super().__init__(stops)
        self.matcher = StopMatcher.build(self)


def matcher_for(stops: Seq[str]) -> StopMatcher:
    return stops.matcher if isinstance(stops, StopStrings) else StopMatcher.build(stops)


@dataclass(slots=True)
class StopScan:
    """One sequence's place in its request's automaton."""

    matcher: StopMatcher
    state: int = 0


def _state_after(m: StopMatcher, text: str) -> int:
    """The state after `text`, read through any matches."""
    state, pos = 0, 0
    while pos < len(text):
        state, end = m.scan(state, text[pos:])
        if end < 0:
            break
        pos += end
    return state


def find_stop(text: str, stops: Seq[str], new_from: int) -> int | None:
    """Start of the stop string that wins in `text[new_from:]` (see the module's
    docstring), or None. append_token's rule on whole texts, for tests and tools."""
    m = matcher_for(stops)
    state, end = m.scan(_state_after(m, text[:new_from]), text[new_from:])
    return None if end < 0 else new_from + end - m.out[state]


def held_back(text: str, stops: Seq[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    m = matcher_for(stops)
    return m.open_depth(_state_after(m, text))


def append_token(seq: Sequence, token: int, eos_token_ids: Iterable[int],
                 max_model_len: int) -> tuple[str, str | None]:
    """Add a sampled token; returns (text to stream now, finish reason or None).

    Stop and EOS tokens end the request and add no text (they are never fed
    to the detokenizer). Without a detokenizer only token ids are produced.
    """
    seq.token_ids.append(token)
    p = seq.params
    reason: str | None = None
    cut_at: int | None = None
    json_done = False
    c = seq.constraint
    if c is not None:  # JSON mode: the object closing ends the request
        try:
            c.advance(token)
            json_done = c.complete
        except ValueError:
            pass  # a token the JSON refuses (EOS, a stop token id): the state stays
    scan: StopScan | None = None
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        reason = "stop"
    elif seq.detokenizer is not None:
        text_delta = seq.detokenizer.add([token])
        start = len(seq.output_text)
        seq.output_text += text_delta
        if p.stop:
            scan = seq.stop_scan
            if scan is None:
                scan = seq.stop_scan = StopScan(matcher_for(p.stop))
            scan.state, end = scan.matcher.scan(scan.state, text_delta)
            if end >= 0:
                cut_at = start + end - scan.matcher.out[scan.state]
                seq.output_text = seq.output_text[:cut_at]
                reason = "stop"
    if reason is None and json_done:
        reason = "stop"
    if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is not None and cut_at is None and seq.detokenizer is not None:
        seq.output_text += seq.detokenizer.flush()   # bytes held for a character that never completed
    end = len(seq.output_text)
    if reason is None and scan is not None:  # no match: the state is a proper prefix
        end -= scan.matcher.depth[scan.state]
    delta = seq.output_text[seq.num_emitted_chars:end] if end > seq.num_emitted_chars else ""
    seq.num_emitted_chars = max(seq.num_emitted_chars, end)
    return delta, reason
