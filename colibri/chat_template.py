"""Chat-template rendering, exactly as transformers renders `apply_chat_template(tokenize=False)`.

Follows `transformers/utils/chat_template_utils.py`: the same sandboxed jinja2 environment
(trim_blocks, lstrip_blocks, loopcontrols, `{% generation %}`), the same `tojson`,
`raise_exception`, `strftime_now`, `dict` and `namespace` globals, and the same message clean-up
(None-valued keys dropped, reasoning fields aliased). Each template string is compiled once.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibri.errors import ColibriError

# Names a message's reasoning arrives under; templates read the first, gpt-oss reads "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRaised(ColibriError):
    """The chat template itself refused the conversation (its `raise_exception(...)`)."""


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         special_tokens: dict[str, str | None] | None = None, **kwargs: Any) -> str:
    """Render `template` over `messages`. Template variables: messages, add_generation_prompt,
    tools and documents (default None), the special tokens (bos_token, eos_token, ...) and
    **kwargs (e.g. enable_thinking), kwargs winning over special tokens as in transformers."""
    compiled = _compile(template)
    chat = _alias_reasoning_fields(_plain([_drop_none(m) for m in messages]))
    variables = {"tools": None, "documents": None,
                 **{k: v for k, v in (special_tokens or {}).items() if v is not None}, **_plain(kwargs)}
    try:
        return compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
    except ColibriError:
        raise
    except Exception as exc:  # undefined keys, str + list (content given as parts), sandbox refusals...
        why = " ".join(str(exc).split())
        raise ColibriError(f"the chat template failed on these messages: {type(exc).__name__}: {why}") from None


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ColibriError(f"the chat template is not valid jinja (line {exc.lineno}: {exc.message})") from None


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _raise_exception(message):
    raise TemplateRaised(" ".join(str(message).split()))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &, '); transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    # `dict(...)` without handing the template the real type (no attribute access to its internals)
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces reject underscore names, so templates cannot reach CPython internals through them.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _drop_none(message) -> dict:
    # OpenAI-style messages carry content=None / tool_calls=None; templates handle a missing key better.
    if not isinstance(message, dict):
        raise ColibriError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value):
    """Rebuild template inputs from plain JSON types: the sandbox only knows those are harmless."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"
