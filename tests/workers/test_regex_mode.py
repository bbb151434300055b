"""guided_regex's automaton against Python's `re` on the same patterns."""
from __future__ import annotations

import random
import re
import string

import pytest

from kvyard.workers.engine.guided.constraint import TokenConstraint
from kvyard.workers.engine.guided.regex import RegexError, RegexState, compile_regex

PATTERNS = [
    r"\d{3}-\d{4}",
    r"(yes|no), because [a-z ]{3,12}\.",
    r"[A-Z][a-z]*( [A-Z][a-z]*)?",
    r"(?:ab|a)+c?",
    r"-?(0|[1-9]\d*)(\.\d+)?",
    r"^\w+@\w+\.(com|org)$",
    r"[^,\n]{1,5}(,[^,\n]{1,5}){0,2}",
    r"x.y*?z",
]
ALPHABET = list(string.ascii_letters + string.digits + "-., @_\n") + ["é"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_walks_match_python_re_and_never_strand(pattern):
    """Random walks over allowed characters: every state can still finish; whenever the
    automaton says the text may end, Python's re fullmatches it, and vice versa for
    the prefixes the walk produced."""
    rx, want = compile_regex(pattern), re.compile(pattern)
    rng = random.Random(pattern)
    for _ in range(60):
        st, text = RegexState.start(rx), ""
        while not st.complete and len(text) < 40:
            assert (want.fullmatch(text) is not None) == st.ends_here, text
            options = [(c, n) for c in ALPHABET if (n := st.feed(c)) is not None]
            if not options:
                assert st.ends_here, text  # stuck only where the match is complete
                break
            if st.ends_here and rng.random() < 0.2:
                break
            c, st = rng.choice(options)
            text += c
        if st.ends_here:
            assert want.fullmatch(text), text


@pytest.mark.parametrize("pattern, good, bad", [
    (r"\d{3}-\d{4}", "555-1234", "555-12345"),
    (r"(yes|no)", "no", "nope"),
    (r"a{2,3}", "aaa", "aaaa"),
    (r"[^0-9]+", "abc", "ab1"),
])
def test_whole_strings(pattern, good, bad):
    st = RegexState.start(compile_regex(pattern))
    assert st.feed(good).ends_here
    assert st.feed(bad) is None or not st.feed(bad).ends_here


def test_complete_when_nothing_longer_can_match_and_eos_where_it_may_end():
    st = RegexState.start(compile_regex(r"(no|none)"))
    assert st.feed("none").complete and not st.feed("no").complete
    texts = {1: "no", 2: "", 3: "ne"}
    c = TokenConstraint(texts.__getitem__, st)
    assert not c.allows(2)
    c.advance(1)
    assert c.allows(2) and c.allows(3)


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=a)b", r"a**", r"(ab", r"ab)", r"a{3,2}",
                                     r"x{1000}", "", r"[a-", "*a"])
def test_unsupported_or_malformed_patterns_are_refused(pattern):
    with pytest.raises(RegexError):
        compile_regex(pattern)
