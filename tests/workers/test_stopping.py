"""Stop strings: the automaton against a brute-force reference on random strings and
token splits, and what append_token streams (never a fragment it later trims)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.sequence import Sequence
from kvyard.workers.engine.stopping import (StopMatcher, StopStrings, append_token, find_stop,
                                            held_back)


def ref_cut(text: str, stops: list[str], new_from: int) -> int | None:
    """The rule, by brute force: the stop string ending first after `new_from`, the
    longest of those ending there; its start."""
    for end in range(new_from + 1, len(text) + 1):
        ending = [s for s in stops if len(s) <= end and text.startswith(s, end - len(s))]
        if ending:
            return end - max(map(len, ending))
    return None


def ref_hold(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(len(s)) if text.endswith(s[:n])), default=0)


def random_case(rng: random.Random) -> tuple[list[str], list[str]]:
    """(stops, chunks) over a small alphabet, so matches and overlaps are frequent."""
    alphabet = rng.choice(["ab", "abc", "aab\u00e9"])
    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))
    stops = [word(1, 6) for _ in range(rng.randint(1, 7))]
    chunks = [word(0, 4) for _ in range(rng.randint(0, 12))]
    return stops, chunks


@dataclass(slots=True)
class ChunkDetokenizer:
    """Token id i decodes to chunks[i]: any split of a text into tokens, empty ones too."""

    chunks: list[str]
    seen: list[int] = field(default_factory=list)

    def add(self, ids: list[int]) -> str:
        self.seen.extend(ids)
        return "".join(self.chunks[i] for i in ids)

    def flush(self) -> str:
        return ""


def stream(chunks: list[str], stops: list[str]) -> tuple[list[str], str | None, str]:
    params = SamplingParams(max_tokens=1000, stop=StopStrings(stops))
    seq = Sequence("r", [0], 1, params)
    seq.detokenizer = ChunkDetokenizer(chunks)
    deltas, reason = [], None
    for i in range(len(chunks)):
        delta, reason = append_token(seq, i, (), 10_000)
        deltas.append(delta)
        if reason:
            break
    return deltas, reason, seq.output_text


def test_matcher_agrees_with_brute_force_on_random_text_and_splits() -> None:
    rng = random.Random(15)
    for _ in range(3000):
        stops, chunks = random_case(rng)
        m = StopMatcher.build(stops)
        text, state = "", 0
        for chunk in chunks:
            start = len(text)
            text += chunk
            state, end = m.scan(state, chunk)
            want = ref_cut(text, stops, start)
            got = None if end < 0 else start + end - m.out[state]
            assert got == want, (stops, chunks, text)
            if got is not None:
                break
            assert m.depth[state] == ref_hold(text, stops), (stops, text)


def test_append_token_streams_what_the_reference_says_and_never_trims_a_sent_fragment() -> None:
    rng = random.Random(16)
    for _ in range(2000):
        stops, chunks = random_case(rng)
        deltas, reason, out = stream(chunks, stops)
        text, sent = "", ""
        for chunk, delta in zip(chunks, deltas):
            start = len(text)
            text += chunk
            sent += delta
            cut = ref_cut(text, stops, start)
            if cut is not None:
                assert reason == "stop" and sent == out == text[:cut], (stops, chunks)
                break
            assert sent == text[:len(text) - ref_hold(text, stops)], (stops, chunks, sent)
        else:
            assert reason is None and out == text


def test_the_outcome_does_not_depend_on_the_token_split() -> None:
    """Stops "abcd" and "bc" on "abcd": "bc" ends first, whether in one delta or four."""
    for chunks in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        deltas, reason, out = stream(chunks + ["zz"], ["abcd", "bc"])
        assert reason == "stop" and out == "".join(deltas) == "a"
    # of the strings ending at the same character, the longest is cut
    assert stream(["xabc"], ["bc", "abc", "c"])[2] == "x"


def test_wrappers_follow_the_same_rule() -> None:
    assert find_stop("xabcd", ["abcd", "bc"], 1) == 2
    assert find_stop("xxbc", ["bc"], 4) is None                    # ended before the new text
    assert held_back("..ab", ["abc", "b"]) == 2
    assert held_back("..ab", ["ab"]) == 0                           # a whole stop is no prefix
    assert held_back("..ab", ["ab", "abx"]) == 2


@pytest.mark.parametrize("stops", [
    ["a" * 511 + chr(98 + i % 20) + str(i) for i in range(128)],   # one long shared prefix
    ["a" * (512 - i) + "b" for i in range(128)],                    # every one a suffix run
    ["\U0001f600" * 3, "\x00", "e\u0301"],                          # astral, NUL, combining
])
def test_awkward_stop_lists(stops: list[str]) -> None:
    rng = random.Random(17)
    for _ in range(20):
        s = rng.choice(stops)
        text = "".join(rng.choice([s[: rng.randint(0, len(s))], "a", "b", "\U0001f600"])
                       for _ in range(8)) + s
        m = StopMatcher.build(stops)
        state, end = m.scan(0, text)
        assert end >= 0
        assert end - m.out[state] == ref_cut(text, stops, 0)


def test_the_automaton_is_built_once_where_the_request_is_validated() -> None:
    """Each token's step reads the request's prebuilt automaton: a step never builds."""
    stops = StopStrings(["never"])
    params = SamplingParams(max_tokens=100, stop=stops)
    seqs = [Sequence(f"r{i}", [0], 1, params) for i in range(3)]
    for s in seqs:
        s.detokenizer = ChunkDetokenizer(["a", "b"] * 10)
    built = StopMatcher.build
    try:
        StopMatcher.build = None  # type: ignore[assignment]  # any build now fails loudly
        for s in seqs:
            for t in range(10):
                append_token(s, t, (), 10_000)
    finally:
        StopMatcher.build = built  # type: ignore[method-assign]
    assert all(s.stop_scan.matcher is stops.matcher for s in seqs)
