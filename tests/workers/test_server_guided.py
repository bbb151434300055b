"""Guided output through the OpenAI API of a real worker: JSON mode, JSON Schema
(`response_format` and vLLM's `guided_json`), `guided_choice` and `guided_regex`."""
from __future__ import annotations

import json

import openai
import pytest

from kvyard.common.models import DEMO_SERVED_NAME

MODEL = DEMO_SERVED_NAME


def test_json_mode_through_the_api(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": 'Return a JSON object with the keys "name" and "age" for '
            'a cat called Tom who is 3.'}]
    full = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=100, temperature=0,
                                          response_format={"type": "json_object"})
    assert json.loads(full.choices[0].message.content) == {"name": "Tom", "age": 3}
    assert full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=100,
                                                 temperature=0, stream=True,
                                                 response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content


def test_json_schema_through_the_api(client: openai.OpenAI) -> None:
    """OpenAI's response_format json_schema and vLLM's guided_json (an object or its JSON
    text) both hold the output to the schema; what the automaton cannot enforce is a 400
    naming the keyword, and the server keeps serving."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"},
                                               "indoor": {"type": "boolean"}},
              "required": ["name", "age", "indoor"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Describe a cat called Tom who is 3, in JSON."}]
    full = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=100, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "cat", "schema": schema, "strict": True}})
    doc = json.loads(full.choices[0].message.content)
    jsonschema.validate(doc, schema)
    assert doc["name"] == "Tom" and doc["age"] == 3
    assert full.choices[0].finish_reason == "stop"
    for guided in (schema, json.dumps(schema)):
        out = client.completions.create(model=MODEL, prompt="A cat as JSON:", max_tokens=100,
                                        temperature=1.0, seed=7, extra_body={"guided_json": guided})
        jsonschema.validate(json.loads(out.choices[0].text), schema)
    for bad, word in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                          "type": "object", "properties": {"d": {"type": "string",
                                                                 "pattern": "^a"}}}}}, "pattern"),
                      ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                          "type": "string"}}}, "root"),
                      ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ask, max_tokens=5,
                                           response_format=bad)
        assert e.value.code == "invalid_value" and word in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=5,
                                       response_format={"type": "json_object"},
                                       extra_body={"guided_json": schema})
    assert e.value.code == "invalid_value"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_guided_choice_through_the_api(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=0,
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no")
    assert out.choices[0].finish_reason == "stop"
    for bad in ([], ["yes", ""], "yes", [1]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ask, max_tokens=5,
                                           extra_body={"guided_choice": bad})
        assert e.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=5,
                                       response_format={"type": "json_object"},
                                       extra_body={"guided_choice": ["yes"]})


def test_guided_regex_through_the_api(client: openai.OpenAI) -> None:
    import re

    out = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20,
                                    temperature=0, extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", out.choices[0].text)
    for bad in (r"(a)\1", "", 5):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                      extra_body={"guided_regex": bad})
        assert e.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"guided_regex": "a", "guided_choice": ["a"]})
