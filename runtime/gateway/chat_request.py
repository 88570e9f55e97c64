"""A chat request made ready for the engine: tools checked, the prompt rendered, how to read the output.

Shared by ``/v1/chat/completions`` and ``/v1/responses`` (which translates its request into a
chat request first). ``tool_choice`` decides what happens to the request's tools:

    "none"       rendered into the prompt; the output is plain content
    "auto"       rendered; tool-call markup in the output becomes ``tool_calls`` (the default)
    "required"   rendered; a grammar makes the model call one or more of them (one when
                 ``parallel_tool_calls`` is false), arguments valid under each schema
    {"function"} rendered; a grammar makes the model call exactly that one
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

import msgspec

from deepinfer.runtime.gateway.chat_images import expand_chat_prompt, image_refs, load_images
from deepinfer.runtime.gateway.chat_output import ChatOutputMode
from deepinfer.runtime.gateway.config import GatewayState
from deepinfer.runtime.gateway.engine_inputs import MAX_SCHEMA_DEPTH, chat_prompt, json_depth, structured_spec
from deepinfer.runtime.gateway.errors import bad_request
from deepinfer.runtime.gateway.openai_protocol import ChatCompletionRequest, NamedToolChoice, StructuredOutputsRequest
from deepinfer.runtime.gateway.tool_calls import function_parameters, template_tools
from deepinfer.runtime.gateway.tool_grammar import ToolGrammarError, tool_call_grammar

MAX_TOOLS = 128
THREAD_THRESHOLD_TOOLS = 8


@dataclass(slots=True)
class PreparedChat:
    request: ChatCompletionRequest  # the request as the engine path reads it (a tool grammar filled in)
    prompt_token_ids: list[int]  # image placeholders expanded to their spans
    mode: ChatOutputMode
    multi_modal_data: dict[str, Any] | None = None  # {"image": [PreparedImage, ...]} in prompt order


def _tool_choice(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if req.tools else "none"), None
    if isinstance(choice, NamedToolChoice):
        return "named", choice.function.name
    return choice, None


def _check_tools(req: ChatCompletionRequest, choice: str, forced: str | None) -> None:
    tools = req.tools or []
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools allows at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools names the function {duplicate!r} more than once", "tools")
    for i, t in enumerate(tools):
        if t.function.parameters is not None and json_depth(t.function.parameters, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise bad_request(f"tools[{i}].function.parameters is nested deeper than {MAX_SCHEMA_DEPTH} levels",
                              f"tools[{i}].function.parameters")
    if choice in ("required", "named") and not tools:
        raise bad_request("tool_choice requires tools to choose from", "tool_choice")
    if forced is not None and forced not in names:
        raise bad_request(f"tool_choice names the function {forced!r}, which is not in tools", "tool_choice")


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """chat_template_kwargs, with ``reasoning_effort`` as the thinking switch when it says nothing
    itself ("none"/"minimal" think not; any other effort thinks)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None and "thinking" not in kwargs and "enable_thinking" not in kwargs:
        thinking = req.reasoning_effort not in ("none", "minimal")
        kwargs["thinking"] = kwargs["enable_thinking"] = thinking  # DeepSeek's and Qwen's spellings
    return kwargs or None


async def prepare_chat(state: GatewayState, req: ChatCompletionRequest) -> PreparedChat:
    choice, forced = _tool_choice(req)
    _check_tools(req, choice, forced)
    tokenizer = state.engine.tokenizer
    tools = template_tools(req.tools) if req.tools else None
    refs = image_refs(req.messages)  # read (and refused) before anything is rendered
    vision = getattr(state.engine, "vision", None)
    if refs and vision is None:
        param = refs[0].param.removesuffix(".image_url") + ".type"
        raise bad_request(f"{param}: this model reads no images; send text content only", param)
    config = state.config
    images = await load_images(refs, allow_urls=config.allow_image_urls, max_bytes=config.max_image_bytes)
    prompt = await chat_prompt(req.messages, tokenizer, add_generation_prompt=req.add_generation_prompt,
                               template_kwargs=_template_kwargs(req), tools=tools)
    multi_modal_data = None
    if images:
        expanded = await expand_chat_prompt(vision, prompt, images, refs[0].param)
        prompt, multi_modal_data = expanded.token_ids, {"image": expanded.images}
    mode = ChatOutputMode.for_prompt(tokenizer, prompt, parse_tools=choice != "none" and bool(req.tools),
                                     forced_tool=forced)
    if choice in ("required", "named"):
        if structured_spec(req) is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with response_format "
                              "or another structured-output constraint", "tool_choice")
        build = functools.partial(tool_call_grammar, function_parameters(req.tools), forced=forced,
                                  parallel_tool_calls=req.parallel_tool_calls is not False,
                                  in_reasoning=bool(mode.in_reasoning))
        try:
            # a few tools take about a millisecond; many (up to MAX_TOOLS) tens: off the loop then
            grammar = await asyncio.to_thread(build) if len(req.tools) > THREAD_THRESHOLD_TOOLS else build()
        except ToolGrammarError as exc:
            raise bad_request(str(exc), "tools", code="invalid_tool_schema") from None
        req = msgspec.structs.replace(req, structured_outputs=StructuredOutputsRequest(grammar=grammar))
    return PreparedChat(req, prompt, mode, multi_modal_data)
