"""Validate an InferenceService the way the API server would, without one: defaults,
the OpenAPI schema (`jsonschema`), then every `x-kubernetes-validations` CEL rule
(`cel-python`) at its node. For tests and the chart's checks of example objects;
needs the test extra.
"""
from __future__ import annotations

from typing import Any

from .crd import apply_defaults
from .schema import OPENAPI_SCHEMA

_K8S_KEYS = ("x-kubernetes-validations", "x-kubernetes-int-or-string",
             "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type",
             "x-kubernetes-list-map-keys")


def _plain(schema: Any) -> Any:
    """The schema as JSON Schema: Kubernetes' extensions dropped, int-or-string kept."""
    if isinstance(schema, list):
        return [_plain(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _plain(v) for k, v in schema.items() if k not in _K8S_KEYS}
    if schema.get("type") == "object" and "properties" in schema \
            and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # the API server prunes or refuses unknown fields
    return out


def _cel_rules(schema: dict[str, Any], value: Any, path: str, errors: list[str]) -> None:
    import celpy

    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = program.evaluate({"self": celpy.json_to_cel(value)})
        except Exception as e:  # noqa: BLE001 - an evaluation error fails the rule, as in K8s
            ok = e
        if isinstance(ok, Exception) or not bool(ok):
            errors.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                _cel_rules(sub, value[name], f"{path}.{name}", errors)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _cel_rules(schema["items"], item, f"{path}[{i}]", errors)


def validate(obj: dict[str, Any]) -> list[str]:
    """The reasons the API server would refuse `obj` (empty: it would accept it)."""
    import jsonschema

    obj = apply_defaults(OPENAPI_SCHEMA, obj)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in jsonschema.Draft7Validator(_plain(OPENAPI_SCHEMA)).iter_errors(obj)]
    if not errors:
        _cel_rules(OPENAPI_SCHEMA["properties"]["spec"], obj.get("spec"), "spec", errors)
    return errors


def compile_rules(schema: dict[str, Any] | None = None) -> list[str]:
    """Every CEL rule in the schema, compiled (the API server refuses a CRD whose rules
    do not compile); returns the rules for counting."""
    import celpy

    schema = OPENAPI_SCHEMA if schema is None else schema
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                celpy.Environment().compile(rule["rule"])
                found.append(rule["rule"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    return found
