"""JSON mode's automaton: valid documents pass at any split, invalid prefixes are caught
at the first wrong character, and completion is exact."""
from __future__ import annotations

import json

import pytest

from kvyard.workers.engine.guided.constraint import TokenConstraint
from kvyard.workers.engine.guided.json_object import MAX_WS, JsonState

VALID = [
    '{}',
    '{"a": 1}',
    '{"name": "Ann", "age": 31, "tags": ["x", "y"], "ok": true, "none": null}',
    '{"n": -0.5e+10, "m": 0, "k": 12.25E3, "z": -7}',
    '{"s": "quote \\" slash \\\\ u \\u00e9 nl \\n", "e": ""}',
    '{"deep": {"a": [1, [2, {"b": false}]], "c": {}}, "arr": []}',
    '{\n  "pretty": [\n    1,\n    2\n  ]\n}',
    '{"unicode": "héllo \ufffd ok"}',
]
INVALID_PREFIXES = [
    '{"a" 1}',           # missing colon
    '{"a": 01}',         # leading zero
    '{"a": 1.}',         # no fraction digits
    '{"a": tru}',        # broken literal
    '{"a": "x\\q"}',     # bad escape
    '{"a": "\\u12G4"}',  # bad hex
    '{"a": 1,}',         # trailing comma
    '{a: 1}',            # unquoted key
    '{"a": 1}}',         # extra close
    '{"a": [1}',         # mismatched close
    '{"a": "tab\there"}',  # raw control character
    '{"a": -}',          # sign without digits
]


def feed_all(text: str, step: int) -> JsonState | None:
    st: JsonState | None = JsonState()
    for i in range(0, len(text), step):
        st = st.feed(text[i:i + step])
        if st is None:
            return None
    return st


@pytest.mark.parametrize("doc", VALID)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_valid_documents_complete_exactly_at_their_end(doc: str, step: int):
    json.loads(doc)  # the fixture itself is valid JSON
    st = feed_all(doc, step)
    assert st is not None and st.complete
    assert not feed_all(doc[:-1], step).complete
    assert st.feed("x") is None and st.feed(" ") is None  # nothing may follow


@pytest.mark.parametrize("bad", INVALID_PREFIXES)
def test_invalid_text_is_refused(bad: str):
    with pytest.raises(ValueError):
        json.loads(bad)
    assert feed_all(bad, 1) is None  # refused at a character, not merely left incomplete


def test_the_top_level_must_be_an_object():
    assert json.loads("[1, 2]") == [1, 2]
    assert JsonState().feed("[") is None and JsonState().feed('"s"') is None


def test_whitespace_runs_are_capped_and_feed_does_not_mutate():
    st = JsonState().feed("{")
    assert st.feed(" " * MAX_WS) is not None and st.feed(" " * (MAX_WS + 1)) is None
    assert st.feed(" " * MAX_WS + '"k"') is not None
    before = (st.stack, st.mode, st.sub, st.ws)
    st.feed('"abc": [1, 2')
    assert (st.stack, st.mode, st.sub, st.ws) == before


def test_constraint_refuses_empty_tokens_and_advances():
    texts = {0: "", 1: "{", 2: '"a"', 3: ":", 4: " 1", 5: "}", 6: "]"}
    c = TokenConstraint(texts.__getitem__)
    assert not c.allows(0) and c.allows(1) and not c.allows(5)
    for t in (1, 2, 3, 4):
        c.advance(t)
    assert not c.complete and c.allows(5) and not c.allows(6)
    c.advance(5)
    assert c.complete
    with pytest.raises(ValueError):
        c.advance(1)
