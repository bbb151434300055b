"""How big a JSON Schema may be for structured output (workers/engine/guided/schema.py).

OpenAI's structured-output limits where it has them (properties, enum values,
their characters), and two of ours for the automaton: at most MAX_SUBSCHEMAS
subschemas, and a value may start as at most MAX_ALTERNATIVES configurations
through at most MAX_UNION_DEPTH nested unions and $refs, since the walk
expands them at every value (exponentially many through shared $refs, and
forever through a $ref that loops back through anyOf with no value in
between). Checked while compiling, so the 400 comes before any token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_PROPERTIES = 5000        # object properties in the whole schema (OpenAI's limit)
MAX_ENUM_VALUES = 1000       # enum values in the whole schema (OpenAI's)
MAX_SCHEMA_CHARS = 120_000   # property names and enum/const values together (OpenAI's)
MAX_SUBSCHEMAS = 10_000
MAX_ALTERNATIVES = 256
MAX_UNION_DEPTH = 64


class SchemaError(ValueError):
    """The schema uses something this automaton cannot enforce, or is malformed."""


@dataclass(slots=True)
class SchemaBudget:
    """What a schema has used of the size limits so far."""

    subschemas: int = 0
    properties: int = 0
    enum_values: int = 0
    chars: int = 0

    def spend(self, where: str, *, subschemas: int = 0, properties: int = 0,
              enum_values: int = 0, chars: int = 0) -> None:
        self.subschemas += subschemas
        self.properties += properties
        self.enum_values += enum_values
        self.chars += chars
        if self.subschemas > MAX_SUBSCHEMAS or self.properties > MAX_PROPERTIES \
                or self.enum_values > MAX_ENUM_VALUES or self.chars > MAX_SCHEMA_CHARS:
            self._refuse(where)

    def _refuse(self, where: str) -> None:
        for what, used, limit in (("subschemas", self.subschemas, MAX_SUBSCHEMAS),
                                  ("properties", self.properties, MAX_PROPERTIES),
                                  ("enum values", self.enum_values, MAX_ENUM_VALUES),
                                  ("characters of property names and enum/const values",
                                   self.chars, MAX_SCHEMA_CHARS)):
            if used > limit:
                raise SchemaError(f"{where}: the schema has more than {limit} {what}")


def check_alternatives(defs: dict[str, Any]) -> None:
    """Each value starts as all its alternatives, followed through unions and $refs
    (schema._start, at runtime): counted per compiled node, iteratively (a $ref
    chain may be long). Refuses cycles that read nothing, too many alternatives and
    too deep a nesting."""
    seen: dict[int, Any] = {}
    todo = list(defs.values())
    while todo:  # every node, once
        n = todo.pop()
        if id(n) not in seen:
            seen[id(n)] = n
            todo.extend(n.options)
            todo.extend(sub for _, sub in n.props)
            if n.items is not None:
                todo.append(n.items)
    done: dict[int, tuple[int, int]] = {}   # id -> (alternatives, depth)
    active: set[int] = set()
    for start in seen.values():
        stack = [(start, False)]
        while stack:
            n, finish = stack.pop()
            if n.kind not in ("union", "ref"):
                continue
            subs = (n.defs[n.target],) if n.kind == "ref" else n.options
            if finish:
                got = [done.get(id(c), (1, 0)) for c in subs]
                alts, depth = sum(a for a, _ in got), 1 + max(d for _, d in got)
                if alts > MAX_ALTERNATIVES or depth > MAX_UNION_DEPTH:
                    raise SchemaError(f"a value may start as more than {MAX_ALTERNATIVES} "
                                      f"alternatives or through more than {MAX_UNION_DEPTH} "
                                      "nested anyOf/oneOf/$ref")
                done[id(n)] = (alts, depth)
                active.discard(id(n))
                continue
            if id(n) in done:
                continue
            if id(n) in active:
                raise SchemaError("a $ref refers back to itself through anyOf/oneOf/$ref "
                                  "with no value in between")
            active.add(id(n))
            stack.append((n, True))
            stack.extend((c, False) for c in subs)
