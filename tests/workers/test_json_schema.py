"""The structured-output automaton: what a schema lets through, character by character."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from kvyard.workers.engine.guided.constraint import TokenConstraint
from kvyard.workers.engine.guided.schema import SchemaError, SchemaState, compile_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1, "maxItems": 2},
        "nick": {"type": ["string", "null"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
TREE = {  # recursion through $defs, allOf of one, anyOf
    "$defs": {"node": {"type": "object",
                       "properties": {"v": {"anyOf": [{"type": "integer"}, {"const": "x"}]},
                                      "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                       "required": ["v"]}},
    "type": "object",
    "properties": {"root": {"allOf": [{"$ref": "#/$defs/node"}], "description": "the root"}},
    "required": ["root"],
}


def feed(schema, text: str):
    return SchemaState.start(compile_schema(schema)).feed(text)


@pytest.mark.parametrize("schema, doc", [
    (PERSON, '{"name": "Tom", "age": 3, "pets": ["cat"]}'),
    (PERSON, '{"name":"Tom\\u00e9\\n","age":-12,"height":1.5e-3,"pets":["dog","cat"],'
             '"nick":null,"ok":false}'),
    (PERSON, '{ "name" : "", "age" : 0, "pets" : [ "cat" ] , "nick" : "T" }'),
    (TREE, '{"root": {"v": 1, "kids": [{"v": "x"}, {"v": 2, "kids": []}]}}'),
    ({"type": "object", "properties": {"n": {"enum": [1, 12, "a"]}}, "required": ["n"]},
     '{"n": 12}'),
    ({"type": "object", "properties": {"n": {"enum": [1, 12]}}}, '{"n": 1}'),
    ({"type": "object"}, '{"any": [1, {"x": null}, "s", true], "k": -0.5}'),
])
def test_valid_documents_complete_at_their_last_character(schema, doc):
    jsonschema.validate(json.loads(doc), schema)  # the fixture itself satisfies the schema
    st = SchemaState.start(compile_schema(schema))
    for i, ch in enumerate(doc):
        assert not st.complete, doc[:i]
        st = st.feed(ch)
        assert st is not None, f"refused at {i}: {doc[:i + 1]!r}"
    assert st.complete


@pytest.mark.parametrize("schema, bad", [
    (PERSON, '{"age"'),                                   # required "name" skipped
    (PERSON, '{"name": "Tom", "pets"'),                   # required "age" skipped
    (PERSON, '{"name": "Tom", "age": 3}'),                # "pets" missing at the close
    (PERSON, '{"name": "Tom", "age": 3.5'),               # not an integer
    (PERSON, '{"name": "Tommy Lee Jones"'),               # longer than maxLength
    (PERSON, '{"name": 3'),                               # wrong type
    (PERSON, '{"name": "T", "age": 1, "pets": []'),       # fewer than minItems
    (PERSON, '{"name": "T", "age": 1, "pets": ["cat", "dog", "cat"'),  # more than maxItems
    (PERSON, '{"name": "T", "age": 1, "pets": ["cow"'),   # not in the enum
    (PERSON, '{"name": "T", "age": 1, "pets": ["cat"], "extra"'),  # undeclared property
    (PERSON, '{"name": "T", "age": 1, "pets": ["cat"], "nick": 1'),  # string or null only
    (PERSON, '{"name": "T", "age": 1, "pets": ["cat"],}'),  # trailing comma
    (PERSON, '{"name": "T", "age": 1, "pets": ["cat"]} '),  # anything after the end
    (TREE, '{"root": {"v": "y"'),                         # neither branch of anyOf
    (TREE, '{"root": {"kids": []'),                       # nested required "v" skipped
])
def test_text_that_breaks_the_schema_is_refused(schema, bad):
    assert feed(schema, bad) is None


def test_optional_properties_keep_the_schema_order():
    """A decision: properties come in the schema's order (optional ones may be
    skipped), so a reordered document is refused even though the schema allows it."""
    assert feed(PERSON, '{"name": "T", "age": 1, "pets": ["cat"], "ok": true}').complete
    assert feed(PERSON, '{"name": "T", "age": 1, "pets": ["cat"], "ok": true, "nick"') is None


@pytest.mark.parametrize("schema, word", [
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a"}}}, "pattern"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date-time"}}}, "format"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "minimum"),
    ({"type": "object", "properties": {"r": {"$ref": "http://x/s.json"}}}, "$ref"),
    ({"type": "array", "items": {"type": "string"}}, "root"),
    ({"anyOf": [{"type": "object"}, {"type": "string"}]}, "root"),
    ({"type": "object", "properties": {"t": {"type": "date"}}}, "type"),
    ([1, 2], "object"),
])
def test_what_cannot_be_enforced_is_refused_by_name(schema, word):
    with pytest.raises(SchemaError, match=re.escape(word)):
        compile_schema(schema)


def test_random_walks_stay_valid_and_always_can_continue():
    """Walk the automaton by random allowed characters: every finished walk is a
    document `jsonschema` accepts, and no walk ever reaches a dead end."""
    rng = random.Random(0)
    alphabet = list('{}[],:" -.0123456789eE+abcdefghijklmnopqrstuvwxyz\\/_') + ["\u00e9"]
    finished = 0
    for schema in (PERSON, TREE):
        for _ in range(40):
            st, text = SchemaState.start(compile_schema(schema)), ""
            while not st.complete and len(text) < 400:
                options = [(ch, nxt) for ch in alphabet if (nxt := st.feed(ch)) is not None]
                assert options, f"dead end after {text!r}"
                # lean towards closing so walks finish
                closers = [o for o in options if o[0] in '}]"']
                ch, st = rng.choice(closers if closers and rng.random() < 0.3 else options)
                text += ch
            if st.complete:
                jsonschema.validate(json.loads(text), schema)
                finished += 1
    assert finished >= 40


def test_constraint_interface_matches_json_mode():
    texts = {1: '{"name": "', 2: "Tom", 3: '", "age": 3', 4: "", 5: ', "pets": ["cat"]}'}
    c = TokenConstraint(texts.__getitem__, SchemaState.start(compile_schema(PERSON)))
    assert c.allows(1) and not c.allows(4) and not c.allows(3)  # "age" must wait for the name
    for t in (1, 2, 3):
        c.advance(t)
    assert not c.complete and not c.allows(4)  # EOS (empty text) before the end: never
    c.advance(5)
    assert c.complete
    with pytest.raises(ValueError):
        c.advance(2)


def test_guided_choice_state_ends_on_a_choice_and_lets_longer_ones_go_on():
    from kvyard.workers.engine.guided.choice import ChoiceState

    st = ChoiceState.start(["no", "none", "yes"])
    assert st.feed("maybe") is None and st.feed("y").feed("es").complete
    no = st.feed("no")
    assert no.ends_here and not no.complete          # "none" still possible: EOS may end it
    assert no.feed("ne").complete and no.feed("x") is None
    texts = {1: "no", 2: "", 3: "ne", 4: "yes!"}
    c = TokenConstraint(texts.__getitem__, st)
    assert not c.allows(2) and c.allows(1) and not c.allows(4)  # no EOS before a choice
    c.advance(1)
    assert c.allows(2) and c.allows(3)                # after "no": EOS or "ne"


def test_prefilter_keeps_every_allowed_token_and_drops_refused_first_characters():
    import numpy as np

    texts = ["", '"', "{", ' "', "na", "name", '"name', "}", "x", "\u00e9", "\"age"]
    codes = np.array([ord(t[0]) if t else -1 for t in texts], dtype=np.int32)
    c = TokenConstraint(texts.__getitem__, SchemaState.start(compile_schema(PERSON)), codes)
    c.advance(2)  # "{"
    ids = np.arange(len(texts))
    kept = set(c.prefilter(ids).tolist())
    assert {i for i in ids if c.allows(i)} <= kept     # nothing allowed is ever dropped
    assert kept == {1, 3, 6, 10}                        # first chars '"' and ' ' only
    assert c.allows(6) and not c.allows(10)             # "name" comes before "age"
