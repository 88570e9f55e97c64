"""Chat templates rendered the way transformers renders them.

A sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text and accepts ``indent``, and the
``raise_exception`` / ``strftime_now`` globals that Hub templates call. Templates are untrusted
input: the sandbox stops attribute escapes, and template errors surface as ``ChatTemplateError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be compiled or refused the conversation; one line, says why."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None


def render_chat(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str | None] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text for ``messages`` (dicts with ``role`` and ``content``)."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ChatTemplateError(f"message {i} must be an object with a 'role', got {message!r}")
    template = compile_template(source)
    try:
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            **dict(special_tokens or {}),
            **kwargs,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from None


def select_template(value: Any, name: str = "default") -> str | None:
    """The template source from a tokenizer_config ``chat_template`` value: a string, or a list of
    ``{"name", "template"}`` entries (transformers' named templates)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if name in named:
            return named[name]
        raise ChatTemplateError(f"no chat template named {name!r}; available: {', '.join(map(str, named))}")
    raise ChatTemplateError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")
