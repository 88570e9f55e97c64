"""From a decoded request to the engine's inputs: the prompt's token ids, the ``max_tokens``
budget its context leaves, ``SamplingParams``; one error per bad field, naming it.

Prompts: the completion forms (a string, strings, token ids, id lists) and chat messages
through the chat template. Large texts are tokenized in a worker thread so one huge prompt never
stalls the event loop (the Rust tokenizer releases the GIL).

Structured output arrives in four spellings and becomes one ``structured_outputs`` dict:

    response_format {"type": "json_object"}                -> {"json_object": True}
    response_format {"type": "json_schema", "json_schema": {"schema": S}}  -> {"json": S}
    structured_outputs {"json"|"regex"|"grammar"|"json_object"|"choice": v}
    guided_json / guided_regex / guided_grammar / guided_choice (older vLLM)

``choice`` (a list of strings) becomes an EBNF grammar that accepts exactly those strings.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.api.protocol import GatewayTokenizer, one_line
from deepinfer.engine.api.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.runtime.gateway.errors import GatewayError, bad_request
from deepinfer.runtime.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ImageUrlPart,
    RefusalPart,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingRequest,
    TextPart,
)
from deepinfer.runtime.gateway.tool_calls import template_tool_calls

# chat_template_kwargs may not override what the gateway itself passes to the template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "tokenize", "chat_template", "tools", "documents",
    "bos_token", "eos_token", "pad_token", "unk_token",
})
THREAD_THRESHOLD_CHARS = 16384
MAX_SCHEMA_DEPTH = 64  # deeper schemas are hostile, not useful; the grammar compiler recurses


# ---- prompts -> token ids ------------------------------------------------------------------------
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
        raise bad_request(f"messages could not be rendered with the chat template: {one_line(exc)}",
                          "messages", code="invalid_chat") from None
    if not isinstance(ids, list):
        raise GatewayError("the tokenizer's chat template returned no token ids", status=500)
    return _check_ids(ids, "messages")


# ---- max_tokens ----------------------------------------------------------------------------------
def requested_max_tokens(req: SamplingRequest) -> tuple[int | None, str]:
    """(limit or None, the field it came from); chat prefers max_completion_tokens."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


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


# ---- SamplingParams ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StructuredSpec:
    spec: dict[str, Any]  # what SamplingParams.structured_outputs receives
    param: str  # the request field it came from (named in errors)


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counting stops once past ``limit`` (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _choice_grammar(choices: list[str], param: str) -> dict[str, Any]:
    if not choices:
        raise bad_request(f"{param} must list at least one string", param)
    if any(not c for c in choices):
        raise bad_request(f"{param} must not contain an empty string", param)
    # json.dumps writes the escapes EBNF string literals use (\" \\ \n \uXXXX)
    return {"grammar": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)}


def _from_fields(kinds: dict[str, Any], prefix: str) -> StructuredSpec | None:
    given = {k: v for k, v in kinds.items() if v is not None and v is not False}
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(f"{prefix}{k}" for k in given)
        raise bad_request(f"give only one of {names}", f"{prefix}{next(iter(given))}")
    kind, value = next(iter(given.items()))
    param = f"{prefix}{kind}"
    if kind == "choice":
        return StructuredSpec(_choice_grammar(value, param), param)
    if kind == "json_object":
        return StructuredSpec({"json_object": True}, param)
    if kind in ("regex", "grammar") and not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return StructuredSpec({kind: value}, param)


def structured_spec(req: SamplingRequest) -> StructuredSpec | None:
    """The one structured-output constraint of a request, or None; 400 if several are given."""
    specs: list[StructuredSpec] = []
    rf = req.response_format
    if isinstance(rf, ResponseFormatJsonObject):
        specs.append(StructuredSpec({"json_object": True}, "response_format"))
    elif isinstance(rf, ResponseFormatJsonSchema):
        schema = rf.json_schema.schema
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        specs.append(StructuredSpec({"json": schema}, "response_format"))
    so = req.structured_outputs
    if so is not None:
        spec = _from_fields(
            {"json": so.json, "regex": so.regex, "grammar": so.grammar, "choice": so.choice, "json_object": so.json_object},
            "structured_outputs.",
        )
        if spec is None:
            raise bad_request("structured_outputs must set one of json, regex, grammar, choice, json_object",
                              "structured_outputs")
        specs.append(spec)
    guided = _from_fields(
        {"json": req.guided_json, "regex": req.guided_regex, "grammar": req.guided_grammar, "choice": req.guided_choice},
        "guided_",
    )
    if guided is not None:
        specs.append(guided)
    if len(specs) > 1:
        raise bad_request(f"give only one structured-output constraint, got {specs[0].param} and {specs[1].param}",
                          specs[1].param)
    if not specs:
        return None
    spec = specs[0]
    value = next(iter(spec.spec.values()))
    if isinstance(value, str) and "json" in spec.spec:
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise GatewayError(f"{spec.param}: the JSON schema is not valid JSON", status=422, param=spec.param,
                               code="invalid_structured_output") from None
        if not isinstance(value, dict):
            raise GatewayError(f"{spec.param}: the JSON schema must be a JSON object", status=422, param=spec.param,
                               code="invalid_structured_output")
        spec = StructuredSpec({"json": value}, spec.param)
    if json_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{spec.param} is nested deeper than {MAX_SCHEMA_DEPTH} levels", spec.param)
    return spec


def stop_strings(req: SamplingRequest, max_stop: int) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > max_stop:
        raise bad_request(f"stop allows at most {max_stop} strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty", "stop")
    return stop


def sampling_params(
    req: SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    structured: StructuredSpec | None,
    stop: list[str],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Engine parameters of one completion (``n`` is 1: the gateway fans choices out itself)."""
    try:
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=None if structured is None else structured.spec,
            priority=req.priority,
            traffic_class=req.traffic_class or "",
        )
    except SamplingParamsError as exc:
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), field) from None
