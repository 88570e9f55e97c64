"""Chat templates rendered the way transformers renders them.

A sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text and accepts ``indent``, and the
``raise_exception`` / ``strftime_now`` globals that Hub templates call. Templates are untrusted
input: the sandbox stops attribute escapes, and template errors surface as ``ChatTemplateError``.

Message text is untrusted too: ``render_chat_guarded`` (what the tokenizer encodes) swaps every
control-token string inside messages and tools for a placeholder before rendering, so that the
control tokens left in the rendered text are exactly the template's markup; ``encode_guarded``
tokenizes such a render, the placeholders' strings as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
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


@dataclass(frozen=True, slots=True)
class GuardedChat:
    """A rendered chat whose message fields had every control-token string (``controls[i]``)
    replaced by the placeholder ``{mark}{i}{mark}``: what remains of a control token in
    ``text`` is the template's own markup. ``restore`` puts the strings back, to be tokenized
    as text."""

    text: str
    mark: str | None  # None: no field held a control-token string (``text`` is the plain render)
    controls: tuple[str, ...]

    def restore(self, segment: str) -> str:
        if self.mark is None or self.mark not in segment:
            return segment
        return re.sub(f"{self.mark}(\\d+){self.mark}", lambda m: self.controls[int(m[1])], segment)


def render_chat_guarded(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    controls: Sequence[str],
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str | None] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> GuardedChat:
    """``render_chat`` for tokenizing: control-token strings (``controls``) inside messages and
    tools become placeholders, so the caller can tell them from the template's markup (a user
    writing ``<｜User｜>`` must not open a turn)."""
    controls = tuple(controls)
    pattern = _controls_pattern(controls)
    if pattern is None or not _any_string(pattern, (messages, tools)):
        return GuardedChat(render_chat(source, messages, add_generation_prompt, special_tokens, tools, **kwargs),
                           None, controls)
    mark = _unused_char((source, messages, tools, kwargs))
    index = {c: i for i, c in enumerate(controls)}

    def guard(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: f"{mark}{index[m[0]]}{mark}", value)
        if isinstance(value, Mapping):
            return {k: guard(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [guard(v) for v in value]
        return value

    guarded_tools = None if tools is None else guard(tools)
    text = render_chat(source, guard(list(messages)), add_generation_prompt, special_tokens, guarded_tools, **kwargs)
    return GuardedChat(text, mark, controls)



def encode_guarded(chat: GuardedChat, tok: tokenizers.Tokenizer, control_ids: frozenset[int],
                   text_only: Callable[[], tokenizers.Tokenizer]) -> list[int]:
    """Token ids of a guarded render: the control tokens (``control_ids``) found in ``chat.text``
    are markup; each stretch between two of them that holds a placeholder is restored and
    re-encoded as text by ``text_only()`` (``text_only_tokenizer``, asked for only then), the
    others keep their ids, so a conversation without control-token strings tokenizes exactly as
    its text does."""
    encoding = tok.encode(chat.text, add_special_tokens=False)
    if chat.mark is None:
        return encoding.ids
    ids: list[int] = []
    stretch: list[int] = []
    start = 0

    def end_stretch(stop: int) -> None:
        segment = chat.text[start:stop]
        if chat.mark in segment:
            ids.extend(text_only().encode(chat.restore(segment), add_special_tokens=False).ids)
        else:
            ids.extend(stretch)

    for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
        if token_id in control_ids:
            end_stretch(begin)
            ids.append(token_id)
            stretch, start = [], end
        else:
            stretch.append(token_id)
    end_stretch(len(chat.text))
    return ids


def text_only_tokenizer(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy of ``tok`` that tokenizes control-token strings as text (a copy: the flag is
    tokenizer state, and prompts are encoded on several threads). Added tokens are marked special
    in it, since ``encode_special_tokens`` leaves non-special ones matched."""
    data = json.loads(tok.to_str())
    for added in data.get("added_tokens", []):
        added["special"] = True
    text_only = tokenizers.Tokenizer.from_str(json.dumps(data))
    text_only.encode_special_tokens = True
    return text_only

@lru_cache(maxsize=8)
def _controls_pattern(controls: tuple[str, ...]) -> re.Pattern[str] | None:
    """Longest first, as the tokenizer matches added tokens."""
    if not controls:
        return None
    return re.compile("|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True)))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _any_string(pattern: re.Pattern[str], value: Any) -> bool:
    return any(pattern.search(s) for s in _strings(value))


def _unused_char(value: Any) -> str:
    """A private-use character that occurs in no string of ``value``: it marks placeholders."""
    strings = list(_strings(value))
    for code in range(0x10FFFD, 0x10F000, -1):
        mark = chr(code)
        if not any(mark in s for s in strings):
            return mark
    raise ChatTemplateError("the conversation uses every private-use character; cannot guard control tokens")


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
