"""The Responses API's response (``POST /v1/responses``) and its event stream.

A request runs the chat path (responses_request.py); nothing is stored, so a response reports
``store: false``. ``ResponseBuilder`` turns a choice's pieces (reasoning, content, tool calls;
chat_output.py) into output items and, for a stream, into the events the official SDK folds into
a response:

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
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from deepinfer.runtime.gateway.chat_output import ChatPieces
from deepinfer.runtime.gateway.responses_request import ResponsesRequest


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
