"""Prompts to token ids: completion prompt forms, chat messages through the chat template, and
the context-length check that decides ``max_tokens``.

Large texts are tokenized in a worker thread so one huge prompt never stalls the event loop
(the Rust tokenizer releases the GIL).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from deepinfer.engine.api.protocol import GatewayTokenizer
from deepinfer.runtime.gateway.errors import GatewayError, bad_request
from deepinfer.runtime.gateway.openai_protocol import ChatMessage, ImageUrlPart, RefusalPart, TextPart
from deepinfer.runtime.gateway.tool_calls import template_tool_calls

# chat_template_kwargs may not override what the gateway itself passes to the template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "tokenize", "chat_template", "tools", "documents",
    "bos_token", "eos_token", "pad_token", "unk_token",
})
THREAD_THRESHOLD_CHARS = 16384


async def _off_loop(num_chars: int, fn, *args, **kwargs):
    if num_chars >= THREAD_THRESHOLD_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _need_tokenizer(tokenizer: GatewayTokenizer | None, what: str, param: str) -> GatewayTokenizer:
    if tokenizer is None:
        raise bad_request(f"this model has no tokenizer, so {what} cannot be used; send token ids", param)
    return tokenizer


def _check_ids(ids: Sequence[int], param: str) -> list[int]:
    """A non-empty id list (the vocabulary range is the engine's to check: InvalidPromptError -> 400)."""
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    return list(ids)


def num_prompts(prompt: str | list[Any]) -> int:
    """How many prompts a /v1/completions ``prompt`` holds (a flat id list is one prompt)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def completion_prompts(
    prompt: str | list[Any], tokenizer: GatewayTokenizer | None
) -> list[list[int]]:
    """Token ids of each prompt of a /v1/completions request (string, strings, ids, id lists)."""
    if isinstance(prompt, str):
        texts, id_lists = [prompt], None
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(p, str) for p in prompt):
        texts, id_lists = prompt, None
    elif all(isinstance(p, int) for p in prompt):
        texts, id_lists = None, [prompt]
    elif all(isinstance(p, list) for p in prompt):
        texts, id_lists = None, prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                          "lists (not a mix)", "prompt")
    if id_lists is not None:
        return [_check_ids(ids, "prompt") for ids in id_lists]
    tok = _need_tokenizer(tokenizer, "a text prompt", "prompt")
    out = []
    for text in texts:
        ids = await _off_loop(len(text), tok.encode, text, add_special_tokens=True)
        out.append(_check_ids(ids, "prompt"))
    return out


def _message_text(i: int, message: ChatMessage) -> str | list[dict[str, str]] | None:
    """The text of a message; with images, the template's parts (text and ``{"type": "image"}``,
    one image marker each: chat_images.py expands them)."""
    content = message.content
    if content is None:
        if message.role == "assistant" and message.tool_calls:
            return None  # an assistant turn that only called tools
        raise bad_request(f"messages[{i}].content is required", f"messages[{i}].content")
    if isinstance(content, str):
        return content
    parts: list[str | None] = []  # None: an image
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            parts.append(part.text)
        elif isinstance(part, RefusalPart):
            parts.append(part.refusal)
        elif isinstance(part, ImageUrlPart):
            parts.append(None)
        else:
            raise bad_request(f"messages[{i}].content[{j}]: only text and image_url content are supported",
                              f"messages[{i}].content[{j}].type")
    if None not in parts:
        return "\n".join(parts)
    return [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template (``developer`` is OpenAI's newer name for ``system``);
    an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` ride along."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _message_text(i, m)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only an assistant message has tool calls",
                                  f"messages[{i}].tool_calls")
            d["tool_calls"] = template_tool_calls(m.tool_calls)
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}].tool_call_id is required in a tool message (the id of the call "
                                  "it answers)", f"messages[{i}].tool_call_id")
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


async def chat_prompt(
    messages: Sequence[ChatMessage],
    tokenizer: GatewayTokenizer | None,
    *,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt's token ids; ``tools`` (OpenAI-shaped function tools) go to the template's
    ``tools`` variable."""
    tok = _need_tokenizer(tokenizer, "chat messages", "messages")
    conversation = template_messages(messages)
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}", "chat_template_kwargs")
    if tools:
        kwargs["tools"] = tools
    num_chars = sum(len(m["content"] or "") for m in conversation) + (len(repr(tools)) if tools else 0)
    try:
        # rendered and tokenized in one call: only the tokenizer can keep the template's control
        # tokens apart from control-token strings inside message text (those stay text)
        ids = await _off_loop(num_chars, tok.apply_chat_template, conversation,
                              add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
    except (ValueError, TypeError) as exc:  # template refused the conversation (raise_exception) or bad kwargs
        raise bad_request(f"messages could not be rendered with the chat template: {_one_line(exc)}",
                          "messages", code="invalid_chat") from None
    if not isinstance(ids, list):
        raise GatewayError("the tokenizer's chat template returned no token ids", status=500)
    return _check_ids(ids, "messages")


def decide_max_tokens(
    num_prompt_tokens: int,
    requested: int | None,
    requested_param: str,
    default: int | None,
    max_model_len: int,
    prompt_param: str,
) -> int:
    """The completion budget: what was asked for, else ``default`` (None = the rest of the context),
    never past the context; 400 naming the field when the request cannot fit."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise GatewayError(
            f"{prompt_param} has {num_prompt_tokens} tokens but the model's context is {max_model_len} tokens "
            "(at least one must be left to generate); shorten it",
            param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise GatewayError(
            f"{requested_param} ({requested}) plus the prompt ({num_prompt_tokens} tokens) exceeds the model's "
            f"context of {max_model_len} tokens; lower {requested_param} to at most {room}",
            param=requested_param, code="context_length_exceeded")
    return requested


def _one_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__
