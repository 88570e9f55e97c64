"""The Responses API's request (``POST /v1/responses``) and the chat request that serves it.

Stateless: ``instructions`` becomes a system message, ``input`` items become messages (a
``function_call`` joins the assistant turn it follows, a ``function_call_output`` is a tool
message), function tools become chat tools, ``text.format`` a response format and
``reasoning.effort`` the thinking switch. What needs stored state (``previous_response_id``,
``conversation``, ``background``) is a 400; past ``reasoning`` items are dropped (templates do
not render them).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Meta, Struct
from typing_extensions import Annotated

from deepinfer.runtime.gateway.errors import bad_request, from_decode_error
from deepinfer.runtime.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    JsonSchemaSpec,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    Seed,
    TokenCount,
    ToolCallRequest,
    ToolChoiceFunction,
)

MAX_INPUT_ITEMS = 4096


class FunctionTool(Struct):
    name: FunctionName
    type: Literal["function"] = "function"
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Struct, tag="function", tag_field="type"):
    name: str


class TextFormat(Struct):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Struct):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Struct, kw_only=True):
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=MAX_INPUT_ITEMS)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None  # function tools are the ones served (``_tools``)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: Seed | None = None  # not OpenAI's; vLLM accepts it
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    stream_options: dict[str, Any] | None = None


class _InputText(Struct):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str = ""


class _MessageItem(Struct):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"


class _FunctionCallItem(Struct):
    call_id: str
    name: str
    arguments: str
    type: Literal["function_call"] = "function_call"


class _FunctionCallOutputItem(Struct):
    call_id: str
    output: str | list[dict[str, Any]]
    type: Literal["function_call_output"] = "function_call_output"


def _convert(value: Any, kind: type, where: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        err = from_decode_error(exc)
        param = f"{where}.{err.param}" if err.param else where
        raise bad_request(f"{where}: {err.message}", param) from None


def _text_of(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(f"{where}[{j}]: only text content is supported by this model, got {kind!r}",
                              f"{where}[{j}].type")
        p = _convert(part, _InputText, f"{where}[{j}]")
        parts.append(p.refusal if p.type == "refusal" else p.text)
    return "".join(parts)


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if req.instructions:
        out.append(ChatMessage("system", req.instructions))
    if isinstance(req.input, str):
        out.append(ChatMessage("user", req.input))
        return out
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            m = _convert(item, _MessageItem, where)
            out.append(ChatMessage(m.role, _text_of(m.content, f"{where}.content")))
        elif kind == "function_call":
            c = _convert(item, _FunctionCallItem, where)
            call = ToolCallRequest(FunctionCall(c.name, c.arguments), id=c.call_id)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # calls join the assistant turn they follow
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            o = _convert(item, _FunctionCallOutputItem, where)
            out.append(ChatMessage("tool", o.output if isinstance(o.output, str) else _text_of(o.output, where),
                                   tool_call_id=o.call_id))
        elif kind == "reasoning":
            continue  # past reasoning is not rendered (templates drop it)
        else:
            raise bad_request(f"{where}: input items of type {str(kind)[:64]!r} are not supported by this server",
                              f"{where}.type")
    if not out:
        raise bad_request("input holds no message", "input")
    return out


def _tools(req: ResponsesRequest) -> list[ChatTool] | None:
    if not req.tools:
        return None
    out = []
    for i, raw in enumerate(req.tools):
        if raw.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported by this server, got "
                              f"{str(raw.get('type'))[:64]!r}", f"tools[{i}].type")
        tool = _convert(raw, FunctionTool, f"tools[{i}]")
        out.append(ChatTool(FunctionDefinition(tool.name, tool.description, tool.parameters, tool.strict)))
    return out


def _response_format(req: ResponsesRequest) -> ResponseFormatJsonSchema | ResponseFormatJsonObject | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormatJsonObject()
    if fmt.schema is None:
        raise bad_request("text.format.schema is required for a json_schema format", "text.format.schema")
    return ResponseFormatJsonSchema(JsonSchemaSpec(fmt.name or "response", fmt.schema, fmt.strict, fmt.description))


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves a (stateless) Responses request; 400 for what it cannot."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id needs stored responses; this server stores none (send the whole "
                          "conversation in input)", "previous_response_id", code="unsupported_parameter")
    if req.conversation is not None:
        raise bad_request("conversation is not supported by this server (it stores nothing)", "conversation",
                          code="unsupported_parameter")
    if req.background:
        raise bad_request("background responses are not supported by this server", "background",
                          code="unsupported_parameter")
    choice = req.tool_choice
    tool_choice = (NamedToolChoice(ToolChoiceFunction(choice.name)) if isinstance(choice, FunctionToolChoice)
                   else choice)
    effort = req.reasoning.effort if req.reasoning is not None else None
    return ChatCompletionRequest(
        messages=_messages(req), model=req.model, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, tools=_tools(req), tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req), reasoning_effort=effort,
        stream=req.stream, user=req.user)
