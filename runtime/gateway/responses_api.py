"""The Responses API (``POST /v1/responses``), stateless: its request, its response and its events.

A request becomes a chat request (``to_chat_request``: ``instructions`` -> system message,
``input`` items -> messages, function tools -> chat tools) and runs the chat path; the output
comes back as Responses items. Nothing is stored (``store`` is reported false), so
``previous_response_id`` and ``conversation`` are refused with a 400.

``ResponseBuilder`` turns a choice's pieces (reasoning, content, tool calls; chat_output.py) into
output items and, for a stream, into the events the official SDK folds into a response:

    response.created, response.in_progress
    per item: response.output_item.added, [response.content_part.added,
              response.output_text.delta | response.reasoning_text.delta | response.function_call_arguments.delta ...,
              response.output_text.done | ..., response.content_part.done], response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it short)

A complete response is built by the same builder with its events discarded.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType
from typing_extensions import Annotated

from deepinfer.runtime.gateway.chat_output import ChatPieces
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


# ---- request ---------------------------------------------------------------------------------
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


# ---- response --------------------------------------------------------------------------------
class OutputTextPart(Struct):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []
    type: str = "output_text"


class ReasoningTextPart(Struct):
    text: str
    type: str = "reasoning_text"


class MessageItem(Struct):
    id: str
    content: list[OutputTextPart]
    status: str = "in_progress"
    role: str = "assistant"
    type: str = "message"


class ReasoningItem(Struct):
    id: str
    content: list[ReasoningTextPart]
    summary: list[Any] = []
    status: str = "in_progress"
    type: str = "reasoning"


class FunctionCallItem(Struct):
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "in_progress"
    type: str = "function_call"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def make_response_usage(num_prompt: int, num_completion: int, num_cached: int, num_reasoning: int) -> ResponseUsage:
    return ResponseUsage(num_prompt, InputTokensDetails(num_cached), num_completion, OutputTokensDetails(num_reasoning),
                         num_prompt + num_completion)


class IncompleteDetails(Struct):
    reason: str


class ResponseObject(Struct):
    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: str
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    instructions: str | None
    metadata: dict[str, str]
    text: dict[str, Any]
    reasoning: dict[str, Any]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    previous_response_id: None = None
    user: str | None = None
    store: bool = False
    background: bool = False
    truncation: str = "disabled"
    object: str = "response"
    completed_at: int | None | UnsetType = UNSET


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response(req: ResponsesRequest, model: str) -> ResponseObject:
    """The response as it stands before any output (what ``response.created`` carries)."""
    tools = [msgspec.to_builtins(t) for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    text = msgspec.to_builtins(req.text) if req.text is not None and req.text.format is not None else {
        "format": {"type": "text"}}
    effort = req.reasoning.effort if req.reasoning is not None else None
    return ResponseObject(
        _new_id("resp"), int(time.time()), model, [], "in_progress", tools, msgspec.to_builtins(choice),
        req.parallel_tool_calls is not False, req.temperature, req.top_p, req.max_output_tokens, req.instructions,
        dict(req.metadata or {}), text, {"effort": effort, "summary": None}, user=req.user)


Event = dict[str, Any]


class ResponseBuilder:
    """Output items of one response from its choice's pieces; ``events`` says what changed."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self._seq = 0
        self._open: OutputItem | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[Event]:
        snapshot = msgspec.to_builtins(self.response)  # events are snapshots: the response changes later
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def add(self, pieces: ChatPieces) -> list[Event]:
        events: list[Event] = []
        if pieces.reasoning:
            item = self._ensure(ReasoningItem, events)
            item.content[0].text += pieces.reasoning
            events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=self._index,
                                      content_index=0, delta=pieces.reasoning))
        if pieces.content:
            item = self._ensure(MessageItem, events)
            item.content[0].text += pieces.content
            events.append(self._event("response.output_text.delta", item_id=item.id, output_index=self._index,
                                      content_index=0, delta=pieces.content, logprobs=[]))
        for call in pieces.tool_calls:
            if call.id is not UNSET:  # a new call
                self._close(events)
                self._open_item(FunctionCallItem(_new_id("fc"), call.id, call.function.name), events)
            item = self._open
            args = call.function.arguments
            if isinstance(item, FunctionCallItem) and args:
                item.arguments += args
                events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                          output_index=self._index, delta=args))
        return events

    def finish(self, status: str, usage: ResponseUsage, incomplete_reason: str | None = None) -> list[Event]:
        events: list[Event] = []
        self._close(events, "incomplete" if status == "incomplete" else "completed")
        r = self.response
        r.status, r.usage = status, usage
        r.incomplete_details = IncompleteDetails(incomplete_reason) if incomplete_reason else None
        if status == "completed":
            r.completed_at = int(time.time())
        events.append(self._event(f"response.{status}", response=msgspec.to_builtins(r)))
        return events

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def _ensure(self, kind: type, events: list[Event]) -> Any:
        if isinstance(self._open, kind):
            return self._open
        self._close(events)
        item = (ReasoningItem(_new_id("rs"), [ReasoningTextPart("")]) if kind is ReasoningItem
                else MessageItem(_new_id("msg"), [OutputTextPart("")]))
        self._open_item(item, events)
        return item

    def _open_item(self, item: OutputItem, events: list[Event]) -> None:
        self.response.output.append(item)
        self._open = item
        shown = msgspec.structs.replace(item, content=[]) if not isinstance(item, FunctionCallItem) else item
        events.append(self._event("response.output_item.added", output_index=self._index,
                                  item=msgspec.to_builtins(shown)))
        if not isinstance(item, FunctionCallItem):
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=self._index,
                                      content_index=0, part=msgspec.to_builtins(item.content[0])))

    def _close(self, events: list[Event], status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status
        at = {"item_id": item.id, "output_index": self._index}
        if isinstance(item, FunctionCallItem):
            events.append(self._event("response.function_call_arguments.done", **at, arguments=item.arguments))
        else:
            part = item.content[0]
            done = "response.reasoning_text.done" if isinstance(item, ReasoningItem) else "response.output_text.done"
            extra = {} if isinstance(item, ReasoningItem) else {"logprobs": []}
            events.append(self._event(done, **at, content_index=0, text=part.text, **extra))
            events.append(self._event("response.content_part.done", **at, content_index=0,
                                      part=msgspec.to_builtins(part)))
        events.append(self._event("response.output_item.done", output_index=self._index,
                                  item=msgspec.to_builtins(item)))
