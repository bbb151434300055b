"""Guided output fields of a request: `response_format` (text, json_object,
json_schema), vLLM's `guided_json`, `guided_choice` and `guided_regex`. Parsed and checked here
(a schema is compiled once, so an unsupported keyword is a 400 naming it), then
handed to the engine as SamplingParams fields; one kind per request."""
from __future__ import annotations

from typing import Any

from kvyard.common.api import BodyError, parse_json_object
from kvyard.workers.engine.guided.schema import SchemaError, compile_schema
from kvyard.workers.engine.guided.regex import RegexError, compile_regex

from .errors import ApiError
from .limits import MAX_GUIDED_CHOICE_CHARS, MAX_GUIDED_CHOICES, MAX_REGEX_CHARS


def guided_params(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams' json_object / json_schema / guided_choice for `body`."""
    schema = _json_schema(body)
    json_object = schema is None and _json_mode(body)
    choices = _guided_choice(body, schema is not None or json_object)
    regex = _guided_regex(body, schema is not None or json_object or choices is not None)
    return {"json_object": json_object, "json_schema": schema, "guided_choice": choices,
            "guided_regex": regex}


def _guided_regex(body: dict[str, Any], other: bool) -> str | None:
    """vLLM's `guided_regex`: the whole output matches it (workers/engine/guided/regex.py);
    compiled here so an unsupported construct is a 400 naming it."""
    pattern = body.get("guided_regex")
    if pattern is None:
        return None
    if not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_REGEX_CHARS:
        raise ApiError(400, f"'guided_regex' must be a pattern of 1 to {MAX_REGEX_CHARS} "
                       "characters", param="guided_regex", code="invalid_value")
    if other:
        raise ApiError(400, "'guided_regex' cannot be combined with another guided output "
                       "(response_format json, guided_json, guided_choice)",
                       param="guided_regex", code="invalid_value")
    try:
        compile_regex(pattern)
    except RegexError as e:
        raise ApiError(400, f"unsupported pattern: {e}", param="guided_regex",
                       code="invalid_value") from None
    return pattern


def _json_mode(body: dict[str, Any]) -> bool:
    """response_format: text (default), json_object, or json_schema (see _json_schema)."""
    rf = body.get("response_format")
    if rf is None:
        return False
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind in ("text", "json_schema"):
        return False
    if kind == "json_object":
        return True
    raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                   "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                   "{\"name\": ..., \"schema\": {...}}}", param="response_format",
                   code="invalid_value")


def _json_schema(body: dict[str, Any]) -> dict | None:
    """The schema of `response_format: {"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}` (OpenAI) or of `guided_json` (vLLM's extra field: a schema
    object or its JSON text), compiled here once so an unsupported keyword is a 400
    naming it, not a failure inside the engine."""
    rf = body.get("response_format")
    param, schema = None, None
    if isinstance(rf, dict) and rf.get("type") == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise ApiError(400, "'response_format.json_schema' must be an object with a "
                           "'schema' object", param="response_format", code="invalid_value")
        param, schema = "response_format", js["schema"]
    guided = body.get("guided_json")
    if guided is not None:
        if param is not None or isinstance(rf, dict) and rf.get("type") == "json_object":
            raise ApiError(400, "give one of 'response_format' and 'guided_json'",
                           param="guided_json", code="invalid_value")
        if isinstance(guided, str):  # the body's own checks (depth, surrogates) again
            try:
                guided = parse_json_object(guided.encode())
            except BodyError as e:
                raise ApiError(400, f"'guided_json': {e.message}", param="guided_json",
                               code=e.code) from None
        if not isinstance(guided, dict):
            raise ApiError(400, "'guided_json' must be a JSON Schema object or its JSON text",
                           param="guided_json", code="invalid_type")
        param, schema = "guided_json", guided
    if schema is None:
        return None
    try:
        compile_schema(schema)
    except SchemaError as e:
        raise ApiError(400, f"unsupported schema: {e}", param=param, code="invalid_value") from None
    return schema


def _guided_choice(body: dict[str, Any], json_too: bool) -> list[str] | None:
    """vLLM's `guided_choice`: a non-empty list of non-empty strings, the output being
    exactly one of them (workers/engine/guided/choice.py); not with a JSON format."""
    choices = body.get("guided_choice")
    if choices is None:
        return None
    if not isinstance(choices, list) or not choices or len(choices) > MAX_GUIDED_CHOICES or \
            not all(isinstance(c, str) and 0 < len(c) <= MAX_GUIDED_CHOICE_CHARS for c in choices):
        raise ApiError(400, f"'guided_choice' must be a list of 1 to {MAX_GUIDED_CHOICES} "
                       f"strings of 1 to {MAX_GUIDED_CHOICE_CHARS} characters",
                       param="guided_choice", code="invalid_value")
    if json_too:
        raise ApiError(400, "'guided_choice' cannot be combined with a JSON response_format "
                       "or 'guided_json'", param="guided_choice", code="invalid_value")
    return list(dict.fromkeys(choices))
