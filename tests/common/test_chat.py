"""Chat template rendering: same jinja behaviour as transformers, clear 400-class errors."""
from __future__ import annotations

import dataclasses
import datetime

import pytest

from kvyard.common.chat import ChatTemplateError

# Exercises what real Hub templates use: loop controls, namespace, tojson with
# non-ASCII and indent, dict(), special-token variables, tools, extra kwargs,
# the {% generation %} tag and block whitespace control.
FEATURES = """{{ bos_token }}
{%- set ns = namespace(n=0, sys=none) %}
{% for m in messages %}
  {% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if ns.n > 3 %}{% break %}{% endif %}
<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}
  {% if m.reasoning_content is defined %}[think:{{ m.reasoning_content }}]{% endif %}
{{ eos_token }}
{% endfor %}
{% if ns.sys %}SYS={{ ns.sys | tojson }}{% endif %}
{% if tools %}TOOLS={{ tools | tojson(indent=2) }}{% endif %}
{{ dict(a=1, b='é') | tojson }} thinking={{ enable_thinking | default(true) }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "weather <b>",
                                           "parameters": {"type": "object", "properties": {}}}}]

CONV = [
    {"role": "system", "content": "Réponds \"vite\" <html>"},
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "  two  ", "reasoning_content": "hmm"},
    {"role": "user", "content": "three"},
    {"role": "assistant", "content": "four"},
]


@pytest.fixture()
def featured(tok):
    return dataclasses.replace(tok, chat_template=FEATURES)


@pytest.mark.parametrize("gen", [True, False])
def test_template_features_match_transformers(featured, hf, gen):
    kw = {"tools": TOOLS, "enable_thinking": False}
    ours = featured.apply_chat_template(CONV, add_generation_prompt=gen, **kw)
    theirs = hf.apply_chat_template(CONV, chat_template=FEATURES, tokenize=False,
                                    add_generation_prompt=gen, **kw)
    assert ours == theirs
    assert "TOOLS=" in ours and '"météo"' in ours and "<b>" in ours and "[think:hmm]" in ours


def test_strftime_now(tok):
    t = dataclasses.replace(tok, chat_template="{{ strftime_now('%Y') }}")
    years = {str(datetime.datetime.now().year + d) for d in (0, 1)}
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) in years


def test_raise_exception_becomes_chat_template_error(tok):
    t = dataclasses.replace(
        tok, chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}ok")
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_sandbox_refuses_private_namespace_attributes(tok):
    t = dataclasses.replace(tok, chat_template="{% set ns = namespace(_evil=1) %}x")
    with pytest.raises(ChatTemplateError):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates_pick_tool_use_only_with_tools(tok):
    t = dataclasses.replace(tok, chat_template={"default": "D", "tool_use": "T"})
    msgs = [{"role": "user", "content": "x"}]
    assert t.apply_chat_template(msgs) == "D"
    assert t.apply_chat_template(msgs, tools=TOOLS) == "T"


def test_model_without_template(tok):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        dataclasses.replace(tok, chat_template=None).apply_chat_template(
            [{"role": "user", "content": "x"}])


def test_broken_template_is_a_server_fault_not_a_client_error(tok):
    t = dataclasses.replace(tok, chat_template="{% for m in messages %}unclosed")
    with pytest.raises(RuntimeError) as ei:
        t.apply_chat_template([{"role": "user", "content": "x"}])
    assert not isinstance(ei.value, ChatTemplateError)


def test_assistant_tool_call_without_content_is_allowed(tok):
    t = dataclasses.replace(tok, chat_template="{% for m in messages %}{{ m['role'] }}:"
                            "{{ m.tool_calls | length if m.tool_calls is defined else m['content'] }};"
                            "{% endfor %}")
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]
    assert t.apply_chat_template(msgs) == "user:x;assistant:1;"


BAD = [
    ([], "at least one message"),
    ("hello", "must be a list"),
    (None, "must be a list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "", "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\] \(user\) has no content"),
    ([{"role": "user", "content": None}], "has no content"),
    ([{"role": "user", "content": 5}], "must be a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only parts of type 'text'"),
    ([{"role": "user", "content": [{"type": "text", "text": 7}]}], r"content\[0\]\.text"),
    ([{"role": "user", "content": ["plain"]}], r"content\[0\] must be an object"),
    ([{"role": "user", "content": "x", "extra": object()}], "JSON data"),
]


@pytest.mark.parametrize("messages,match", BAD)
def test_bad_messages_raise_chat_template_error(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError):  # servers may catch the base class
        tok.encode_chat(messages)


def test_bad_tools_raise_chat_template_error(tok):
    with pytest.raises(ChatTemplateError, match="tools"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tools="nope")


CONTINUE = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}],
    [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "trailing space "}],
]


@pytest.mark.parametrize("conv", CONTINUE)
def test_continue_final_message_matches_transformers(tok, hf, conv):
    ours = tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    theirs = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False,
                                    continue_final_message=True)
    assert ours == theirs
    assert ours.endswith(conv[-1]["content"])


def test_continue_final_message_excludes_generation_prompt(tok):
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        tok.apply_chat_template(CONTINUE[0], add_generation_prompt=True, continue_final_message=True)


def test_continue_final_message_with_a_trimming_template(tok, hf):
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>{% endfor %}"
    t = dataclasses.replace(tok, chat_template=tpl)
    ours = t.apply_chat_template(CONTINUE[1], add_generation_prompt=False, continue_final_message=True)
    assert ours == hf.apply_chat_template(CONTINUE[1], chat_template=tpl, tokenize=False,
                                          add_generation_prompt=False, continue_final_message=True)
    assert ours.endswith("<assistant>trailing space")
