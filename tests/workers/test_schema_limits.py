"""Structured output's size bounds: a schema whose walk would blow up (exponentially
many alternatives through shared $refs, a $ref cycle that reads nothing, a long
$ref chain) or that is past OpenAI's limits is refused when compiled, not on the
engine thread."""
from __future__ import annotations

import pytest

from kvyard.workers.engine.guided import schema_limits as lim
from kvyard.workers.engine.guided.schema import SchemaError, SchemaState, compile_schema


def _with_defs(defs: dict, first: str = "a0") -> dict:
    return {"type": "object", "properties": {"x": {"$ref": f"#/$defs/{first}"}}, "$defs": defs}


def _doubling(k: int) -> dict:
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]}
            for i in range(k)}
    defs[f"a{k}"] = {"type": "string"}
    return _with_defs(defs)


def test_alternatives_doubling_through_shared_refs_are_refused() -> None:
    compile_schema(_doubling(8))                        # 256 alternatives: the bound
    with pytest.raises(SchemaError, match="alternatives"):
        compile_schema(_doubling(24))                   # 16 million: seconds per character


@pytest.mark.parametrize("defs", [
    {"a0": {"anyOf": [{"$ref": "#/$defs/a0"}, {"type": "null"}]}},       # through a union
    {"a0": {"$ref": "#/$defs/a1"}, "a1": {"oneOf": [{"$ref": "#/$defs/a0"}]}},
    {"a0": {"$ref": "#/$defs/a0"}},                                        # a bare loop
])
def test_a_ref_cycle_that_reads_nothing_is_refused(defs: dict) -> None:
    with pytest.raises(SchemaError, match="refers back to itself"):
        compile_schema(_with_defs(defs))


def test_a_recursive_schema_through_values_still_compiles_and_walks() -> None:
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    st = SchemaState.start(compile_schema(tree)).feed('{"kids": [{"kids": [{"kids": []}]}]}')
    assert st is not None and st.complete


def test_a_long_ref_chain_is_refused_at_compile_time() -> None:
    n = lim.MAX_UNION_DEPTH + 10
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    with pytest.raises(SchemaError, match="nested"):
        compile_schema(_with_defs(defs))


@pytest.mark.parametrize("schema, what", [
    ({"type": "object", "properties": {f"p{i}": {} for i in range(lim.MAX_PROPERTIES + 1)}},
     "properties"),
    ({"type": "object", "properties": {"e": {"enum": list(range(lim.MAX_ENUM_VALUES + 1))}}},
     "enum values"),
    ({"type": "object", "properties": {"c": {"const": "x" * lim.MAX_SCHEMA_CHARS}}},
     "characters"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}] * lim.MAX_SUBSCHEMAS}}},
     "subschemas"),
    ({"type": "object", "$defs": [1]}, "must be an object"),
])
def test_size_bounds(schema: dict, what: str) -> None:
    with pytest.raises(SchemaError, match=what):
        compile_schema(schema)


def test_a_schema_compiles_once_for_the_server_and_the_engine_thread() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    root = compile_schema(schema)
    assert compile_schema({"type": "object", "properties": dict(schema["properties"])}) is root
    swapped = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    assert compile_schema(swapped) is not root            # key order is the output's order
