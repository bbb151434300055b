"""Chat messages in, prompt text out, exactly as transformers renders it.

The EPP renders the prompt to hash its tokens and the worker renders it again
to run it; both must land on the same text as `transformers`'
`apply_chat_template`, or prefix-cache routing silently misses. So the jinja
environment copies transformers' settings (sandbox, trim/lstrip blocks, loop
controls, `tojson` without HTML escaping, `raise_exception`, `strftime_now`,
the `{% generation %}` tag) and the messages are normalised the same way.

Anything wrong with a request's messages, including a template's own
`raise_exception`, surfaces as `ChatTemplateError`, which servers map to 400.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: a client error, not a server fault."""


# Names a message's reasoning may arrive under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any, where: str) -> Any:
    """A JSON-only copy, so templates never see caller objects (the sandbox only
    knows builtin types are harmless) and never mutate the caller's messages."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    raise ChatTemplateError(f"{where}: values must be JSON data, got {type(value).__name__}")


def _text_of(content: Any, where: str) -> str:
    """OpenAI content is a string or a list of parts; only text parts are
    supported and they are joined with newlines (vLLM's "string" format)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where}.content[{j}] must be an object")
        if part.get("type") != "text":
            raise ChatTemplateError(
                f"{where}.content[{j}]: only parts of type 'text' are supported, got {part.get('type')!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated plain copies: keys with None values dropped (as transformers
    does), content flattened to a string, reasoning aliases filled in."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"{where} must be an object, got {type(msg).__name__}")
        m = {str(k): v for k, v in msg.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}.role must be a non-empty string")
        if "content" in m:
            m["content"] = _text_of(m["content"], where)
        elif not (role == "assistant" and m.get("tool_calls")):
            raise ChatTemplateError(f"{where} ({role}) has no content")
        m = _plain(m, where)
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` marks assistant spans for training masks; rendering just
    emits the body, but templates using it must still parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """Namespaces that refuse underscore attributes, closing a sandbox escape route."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _DictMaker:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        # A broken model template is a deployment fault, not the client's.
        raise RuntimeError(f"the model's chat template does not parse: {e}") from e


def select_template(template: str | Mapping[str, str] | None, tools: Any) -> str:
    """A model may ship named templates; 'tool_use' serves requests with tools."""
    if template is None:
        raise ChatTemplateError("this model has no chat template; use the completions API")
    if isinstance(template, str):
        return template
    if tools and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ChatTemplateError(f"no default chat template among {sorted(template)}")


# Appended to the message being continued, then cut from the rendered text; the
# trailing space reveals whether the template trimmed the message's end.
_CONTINUE_MARK = "\ue000kvyard-continue "


def _cut_at_mark(rendered: str, continued: str) -> str:
    """The prompt up to where the continued message's text ends."""
    mark = _CONTINUE_MARK.strip()
    at = rendered.rfind(mark)
    if at < 0 or continued.strip() not in rendered[:at]:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not render the final message verbatim")
    if rendered.startswith(_CONTINUE_MARK, at):
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed trailing space, so do we


def render_chat(template: str | Mapping[str, str] | None, messages: Any, *,
                special_tokens: Mapping[str, str | None], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                documents: list[dict] | None = None, **kwargs: Any) -> str:
    """The prompt text transformers' `apply_chat_template(tokenize=False)` would give.

    `continue_final_message` leaves the last message open so the model extends
    it (vLLM's and transformers' option of that name, e.g. for prefilled
    assistant replies); it excludes `add_generation_prompt`."""
    source = select_template(template, tools)
    msgs = normalize_messages(messages)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise ChatTemplateError("tools must be a list of JSON schema objects")
    if documents is not None and not (isinstance(documents, list)
                                      and all(isinstance(d, Mapping) for d in documents)):
        raise ChatTemplateError("documents must be a list of objects")
    continued = ""
    if continue_final_message:
        if add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other")
        continued = msgs[-1].get("content")
        if not isinstance(continued, str):
            raise ChatTemplateError("continue_final_message: the final message has no content")
        msgs[-1]["content"] = continued + _CONTINUE_MARK
    variables = {**special_tokens, **_plain(kwargs, "chat_template_kwargs")}
    try:
        rendered = compile_template(source).render(
            messages=msgs, tools=_plain(tools, "tools"), documents=_plain(documents, "documents"),
            add_generation_prompt=add_generation_prompt, **variables)
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError,
            IndexError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e
    return _cut_at_mark(rendered, continued) if continue_final_message else rendered
