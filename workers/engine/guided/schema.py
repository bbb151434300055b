"""Structured output (`response_format: {"type": "json_schema", ...}`, vLLM's
`guided_json`): the output is one JSON object that satisfies a JSON Schema.

The schema is compiled into a tree of `Node`s; a nondeterministic, character-level
pushdown automaton walks the output against it. A state is the set of live
configurations (a union such as `["string", "null"]` or an enum like `[1, 12]`
keeps several alive for a few characters), so checking a candidate token is a
few set steps per character, as in JSON mode (json_object.py), whose constraint
class and sampler path this reuses.

Decisions (what a demanding user needs to know; the server says it in its 400s):
- The root must be an object (OpenAI's contract for structured outputs): an
  object closes itself, so the request can finish the moment it does.
- Properties come out in the schema's order; optional ones may be skipped,
  required ones may not; no property the schema does not declare is ever
  produced (valid under any `additionalProperties`, and what strict mode wants).
- Enforced: type (and type lists), properties, required, items, minItems,
  maxItems, minLength, maxLength, enum, const, anyOf/oneOf (as a union; oneOf's
  "exactly one" is not checked), allOf of one schema, local `$ref` ("#",
  "#/$defs/...", "#/definitions/...", recursion included), `nullable`. An object
  schema without properties is free-form (any keys, any values).
- Refused (SchemaError -> 400), because output could violate them: pattern,
  format, minimum/maximum and friends, multipleOf, uniqueItems, prefixItems,
  min/maxProperties, not, if/then/else, dependent*, remote `$ref`s.
- Annotations (title, description, default, examples, ...) are ignored.
- Whitespace outside strings: runs of at most MAX_WS, as in JSON mode.
- Size: bounded while compiling (schema_limits.py), SchemaError beyond.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .json_object import _HEX, _N_DONE_OK, _N_INT, _N_SIGN, _N_ZERO, _WS, MAX_WS, number_step
from .schema_limits import SchemaBudget, SchemaError, check_alternatives

# SchemaError lives in schema_limits (which this imports); it is part of this API too
__all__ = ["Node", "SchemaError", "SchemaState", "compile_schema"]

_ESC = '"\\/bfnrt'
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "readOnly", "writeOnly", "deprecated", "$defs", "definitions", "strict",
                "additionalProperties", "patternProperties", "propertyNames", "unevaluatedProperties"}
_REFUSED = {"pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
            "multipleOf", "uniqueItems", "prefixItems", "contains", "minContains", "maxContains",
            "minProperties", "maxProperties", "not", "if", "then", "else", "dependentRequired",
            "dependentSchemas", "unevaluatedItems", "contentEncoding", "contentMediaType"}
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


@dataclass(eq=False, slots=True)
class Node:
    """One compiled schema. kind: any | object | array | string | number | integer |
    choice (literal JSON texts: enum, const, boolean, null) | union | ref | key."""

    kind: str
    props: tuple = ()                 # object: ((key text after its opening quote, Node), ...)
    required: frozenset = frozenset()  # object: indices into props
    items: "Node | None" = None
    min_items: int = 0
    max_items: int | None = None
    min_len: int = 0
    max_len: int | None = None
    literals: tuple = ()              # choice
    options: tuple = ()               # union
    target: str = ""                  # ref: a key of `defs`
    defs: dict = field(default_factory=dict)
    free: bool = False                # object without properties: any keys, any values

    def resolve(self) -> "Node":
        n, seen = self, 0
        while n.kind == "ref":
            n, seen = n.defs[n.target], seen + 1
            if seen > 64:
                raise SchemaError("$ref cycle without a schema in between")
        return n


ANY = Node("any")
_KEY = Node("key")


_compiled: OrderedDict[str, Node] = OrderedDict()  # the schema's JSON text -> root
_compiled_lock = threading.Lock()


def compile_schema(schema: Any) -> Node:
    """The root Node; SchemaError when the schema cannot be enforced. The last few
    schemas' roots are kept by their JSON text (key order kept: it is the output's),
    so the engine thread's add_request reuses what the server's validation compiled,
    and repeated schemas compile once; Nodes never change after compiling."""
    try:
        key = json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError):
        return _compile_root(schema)
    with _compiled_lock:
        root = _compiled.get(key)
        if root is not None:
            _compiled.move_to_end(key)
            return root
    root = _compile_root(schema)
    with _compiled_lock:
        _compiled[key] = root
        while len(_compiled) > 32:
            _compiled.popitem(last=False)
    return root


def _compile_root(schema: Any) -> Node:
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    defs: dict[str, Node] = {}
    sources = {}
    for section in ("$defs", "definitions"):
        subs = schema.get(section) or {}
        if not isinstance(subs, dict):
            raise SchemaError(f"{section} must be an object of schemas")
        for name, sub in subs.items():
            sources[f"#/{section}/{name}"] = sub
    sources["#"] = schema
    for ref, sub in sources.items():
        defs[ref] = Node("ref")  # placeholders first: refs may point anywhere, recursively
    budget = SchemaBudget()
    for ref, sub in sources.items():
        defs[ref] = _compile(sub, defs, f"{ref}", budget)
    check_alternatives(defs)
    root = defs["#"].resolve()
    if root.kind != "object":
        raise SchemaError("the root of the schema must be an object (type: object)")
    return defs["#"]


def _compile(s: Any, defs: dict, where: str, b: SchemaBudget) -> Node:
    if s is True or s == {}:
        return ANY
    if not isinstance(s, dict):
        raise SchemaError(f"{where}: a schema must be an object")
    b.spend(where, subschemas=1)
    bad = sorted(k for k in s if k in _REFUSED)
    if bad:
        raise SchemaError(f"{where}: keyword {bad[0]!r} is not supported by structured output")
    if "$ref" in s:
        ref = s["$ref"]
        if not isinstance(ref, str) or ref not in defs:
            raise SchemaError(f"{where}: only local $refs to '#', '#/$defs/...' or "
                              f"'#/definitions/...' are supported, got {ref!r}")
        return Node("ref", target=ref, defs=defs)
    if "allOf" in s:
        parts = s["allOf"]
        if not isinstance(parts, list) or len(parts) != 1:
            raise SchemaError(f"{where}: allOf is supported with exactly one schema")
        rest = {k: v for k, v in s.items() if k != "allOf"}
        if set(rest) - _ANNOTATIONS:
            raise SchemaError(f"{where}: allOf next to other constraints is not supported")
        return _compile(parts[0], defs, f"{where}/allOf/0", b)
    if "const" in s:
        lit = _lit(s["const"])
        b.spend(where, chars=len(lit))
        return Node("choice", literals=(lit,))
    if "enum" in s:
        if not isinstance(s["enum"], list) or not s["enum"]:
            raise SchemaError(f"{where}: enum must be a non-empty list")
        b.spend(where, enum_values=len(s["enum"]))
        lits = tuple(dict.fromkeys(_lit(v) for v in s["enum"]))
        b.spend(where, chars=sum(map(len, lits)))
        return Node("choice", literals=lits)
    for key in ("anyOf", "oneOf"):
        if key in s:
            alts = s[key]
            if not isinstance(alts, list) or not alts:
                raise SchemaError(f"{where}: {key} must be a non-empty list")
            return Node("union", options=tuple(_compile(a, defs, f"{where}/{key}/{i}", b)
                                               for i, a in enumerate(alts)))
    types = s.get("type")
    if types is None:
        types = ["object"] if "properties" in s else ["array"] if "items" in s else None
    if types is None:
        return ANY
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
        raise SchemaError(f"{where}: type must be one of {', '.join(_TYPES)} (or a list of them)")
    if s.get("nullable") is True and "null" not in types:
        types = [*types, "null"]
    nodes = [_typed(t, s, defs, where, b) for t in dict.fromkeys(types)]
    return nodes[0] if len(nodes) == 1 else Node("union", options=tuple(nodes))


def _typed(t: str, s: dict, defs: dict, where: str, b: SchemaBudget) -> Node:
    if t == "boolean":
        return Node("choice", literals=("true", "false"))
    if t == "null":
        return Node("choice", literals=("null",))
    if t in ("number", "integer"):
        return Node(t)
    if t == "string":
        lo, hi = _bounds(s, "minLength", "maxLength", where)
        return Node("string", min_len=lo, max_len=hi)
    if t == "array":
        lo, hi = _bounds(s, "minItems", "maxItems", where)
        items = s.get("items", True)
        return Node("array", items=_compile(items, defs, f"{where}/items", b), min_items=lo,
                    max_items=hi)
    props = {} if s.get("properties") is None else s["properties"]
    req = [] if s.get("required") is None else s["required"]
    if not isinstance(props, dict) or not isinstance(req, list):
        raise SchemaError(f"{where}: properties must be an object and required a list")
    if not props and not req:
        return Node("object", free=True)
    if not all(isinstance(r, str) for r in req):
        raise SchemaError(f"{where}: required must list property names")
    names = list(dict.fromkeys([*props, *req]))  # required but undeclared: any value
    b.spend(where, properties=len(names), chars=sum(map(len, names)))
    compiled = tuple((json.dumps(n, ensure_ascii=False)[1:],
                      _compile(props.get(n, True), defs, f"{where}/properties/{n}", b))
                     for n in names)
    return Node("object", props=compiled, required=frozenset(names.index(r) for r in req))


def _bounds(s: dict, lo_key: str, hi_key: str, where: str) -> tuple[int, int | None]:
    lo, hi = s.get(lo_key, 0), s.get(hi_key)
    if not isinstance(lo, int) or lo < 0 or hi is not None and (not isinstance(hi, int) or hi < lo):
        raise SchemaError(f"{where}: {lo_key}/{hi_key} must be integers with min <= max")
    return lo, hi


def _lit(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


# -- the automaton ----------------------------------------------------------------------
# A configuration: (stack, mode, arg, ws). stack frames: ("O", node, next prop index) or
# ("A", node, items so far). Modes: V value of node `arg` | S string (node, chars, escape)
# | N number (integer only, sub-state) | L literal suffixes | K key or '}' (arg: first?)
# | KS key text (candidates) | C colon (prop index) | X ',' or a close | D done.

def _done(stack: tuple) -> tuple:
    return (stack, "X", None, 0) if stack else ((), "D", None, 0)


def _start(stack: tuple, node: Node, ch: str) -> list:
    node = node.resolve()
    k = node.kind
    if k == "union":
        return [c for o in node.options for c in _start(stack, o, ch)]
    if k == "choice":
        rest = [lit[1:] for lit in node.literals if lit[0] == ch]
        return _literal(stack, rest)
    if ch == "{" and k in ("object", "any"):
        return [(stack + (("O", node, 0),), "K", True, 0)]
    if ch == "[" and k in ("array", "any"):
        return [(stack + (("A", node, 0),), "K", True, 0)]
    if ch == '"' and k in ("string", "any"):
        return [(stack, "S", (node, 0, 0), 0)]
    if (ch == "-" or "0" <= ch <= "9") and k in ("number", "integer", "any"):
        sub = _N_SIGN if ch == "-" else _N_ZERO if ch == "0" else _N_INT
        return [(stack, "N", (k == "integer", sub), 0)]
    if k == "any" and ch in "tfn":
        return _literal(stack, [lit[1:] for lit in ("true", "false", "null") if lit[0] == ch])
    return []


def _literal(stack: tuple, rest: list) -> list:
    out = [_done(stack)] if "" in rest else []
    live = tuple(r for r in rest if r)
    return out + ([(stack, "L", live, 0)] if live else [])


def _keys(node: Node, pos: int) -> tuple:
    """(remaining key text, index) of the properties that may come next: any from
    `pos` up to and including the first required one."""
    out = []
    for j in range(pos, len(node.props)):
        out.append((node.props[j][0], j))
        if j in node.required:
            break
    return tuple(out)


def _step(cfg: tuple, ch: str) -> list:
    stack, mode, arg, ws = cfg
    if mode == "S":
        return _string(stack, arg, ch)
    if mode == "N":
        return _number(stack, arg, ch)
    if mode == "L":
        return _literal(stack, [r[1:] for r in arg if r[0] == ch])
    if mode == "KS":
        nxt = [(r[1:], j) for r, j in arg if r[0] == ch]
        return [(stack, "C", j, 0) if not r else (stack, "KS", ((r, j),), 0) for r, j in nxt] \
            if len(nxt) <= 1 else [(stack, "KS", tuple(nxt), 0)]
    if ch in _WS:
        return [] if mode == "D" or ws >= MAX_WS else [(stack, mode, arg, ws + 1)]
    if mode == "V":
        return _start(stack, arg, ch)
    if mode == "C":
        if ch != ":":
            return []
        kind, node, _ = stack[-1]
        value = ANY if arg is None else node.props[arg][1]
        top = (kind, node, 0 if arg is None else arg + 1)
        return [(stack[:-1] + (top,), "V", value, 0)]
    if mode in ("K", "X"):
        return _in_container(stack, mode, arg, ch)
    return []


def _in_container(stack: tuple, mode: str, first: bool, ch: str) -> list:
    kind, node, n = stack[-1]
    if kind == "A":
        lo, hi = (node.min_items, node.max_items) if node.kind == "array" else (0, None)
        items = node.items if node.kind == "array" else ANY
        if ch == "]" and n >= lo and (mode == "X" or first):
            return [_done(stack[:-1])]
        if mode == "K" and first or mode == "X" and ch == ",":
            if hi is not None and n >= hi:
                return []
            grown = stack[:-1] + (("A", node, n + 1),)
            return _start(grown, items, ch) if mode == "K" else [(grown, "V", items, 0)]
        return []
    free = node.kind == "any" or node.free
    closable = free or not any(j >= n for j in node.required)
    if ch == "}" and closable and (mode == "X" or first):
        return [_done(stack[:-1])]
    if mode == "X":
        more = free or n < len(node.props)
        return [(stack, "K", False, 0)] if ch == "," and more else []
    if ch != '"':
        return []
    if free:
        return [(stack, "S", (_KEY, 0, 0), 0)]
    cands = _keys(node, n)
    return [(stack, "KS", cands, 0)] if cands else []


def _string(stack: tuple, arg: tuple, ch: str) -> list:
    node, count, esc = arg
    hi = node.max_len
    if esc == 1:
        if ch == "u":
            return [(stack, "S", (node, count, 2), 0)]
        return [(stack, "S", (node, count, 0), 0)] if ch in _ESC else []
    if esc >= 2:
        return [(stack, "S", (node, count, esc + 1 if esc < 5 else 0), 0)] if ch in _HEX else []
    if ch == '"':
        if count < node.min_len:
            return []
        return [(stack, "C", None, 0)] if node is _KEY else [_done(stack)]
    if hi is not None and count >= hi or ord(ch) < 0x20:
        return []
    return [(stack, "S", (node, count + 1, 1 if ch == "\\" else 0), 0)]


def _number(stack: tuple, arg: tuple, ch: str) -> list:
    integer, s = arg
    nxt = number_step(s, ch, integer)
    if nxt is not None:
        return [(stack, "N", (integer, nxt), 0)]
    if s not in _N_DONE_OK:
        return []
    return _step(_done(stack), ch)  # the number ended: ch belongs to what follows


@dataclass(slots=True, frozen=True)
class SchemaState:
    """The live configurations; the same interface as json_object.JsonState."""

    configs: frozenset

    @classmethod
    def start(cls, root: Node) -> "SchemaState":
        return cls(frozenset({((), "V", root, 0)}))

    @property
    def complete(self) -> bool:
        return any(c[1] == "D" for c in self.configs)

    ends_here = False  # the root object's closing ends the output, not the end of sequence

    def feed(self, text: str) -> "SchemaState | None":
        cur = self.configs
        for ch in text:
            nxt = set()
            for c in cur:
                nxt.update(_step(c, ch))
            if not nxt:
                return None
            cur = nxt
        return SchemaState(frozenset(cur))
