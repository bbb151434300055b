"""guided_regex's counted repeats (copies of a fragment, cloned) against Python's `re`,
and the compiled pattern being shared by the server's check and the engine."""
from __future__ import annotations

import itertools
import random
import re

import pytest

from kvyard.workers.engine.guided.regex import MAX_STATES, RegexError, RegexState, compile_regex

PATTERNS = [r"a{2,}b", r"(ab|c){2,}", r"(x(y|z){2,4}){1,3}", r"((a|b)c?){0,2}d{3,}",
            r"(a{1,2}b){2}", r"(?:[ab]{2,3}){2,}", r"(a*b){3}"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_short_string_matches_as_python_re_says(pattern: str) -> None:
    """All strings up to 5 characters over the pattern's letters and one more, then
    random longer ones."""
    rx, want = compile_regex(pattern), re.compile(pattern)
    letters = sorted(set(re.findall(r"[a-z]", pattern.replace("?:", ""))) | {"q"})
    rng = random.Random(pattern)
    texts = ["".join(t) for n in range(6) for t in itertools.product(letters, repeat=n)]
    texts += ["".join(rng.choice(letters) for _ in range(rng.randint(6, 14))) for _ in range(2000)]
    for text in texts:
        st = RegexState.start(rx).feed(text)
        assert (st is not None and st.ends_here) == bool(want.fullmatch(text)), text


def test_a_pattern_past_the_state_bound_is_refused_and_one_under_it_compiles() -> None:
    with pytest.raises(RegexError, match=str(MAX_STATES)):
        compile_regex(r"((a?){100}){49}")
    assert compile_regex(r"(?:[a-z]{1,64}\s){1,150}") is compile_regex(r"(?:[a-z]{1,64}\s){1,150}")
