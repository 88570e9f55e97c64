"""What a chat choice's text means: reasoning, answer content and tool calls, as OpenAI shows them.

One ``ChatOutputParser`` per choice runs the text through the reasoning splitter (templates
with ``<think>``) and then the tool-call parser (requests whose tools may be called), the same
way for a streamed choice (``feed`` each delta) and a complete one (``parse_message``):

    text --ReasoningParser--> reasoning_content
                         \\--> answer --ToolCallParser--> content + tool_calls
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.engine.api.protocol import GatewayTokenizer
from deepinfer.runtime.gateway.openai_responses import (
    AssistantMessage,
    ChatDelta,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from deepinfer.runtime.gateway.reasoning import ReasoningParser, think_tokens
from deepinfer.runtime.gateway.tool_calls import ArgumentsDelta, CallStarted, Content, ToolCall, ToolCallParser


@dataclass(frozen=True, slots=True)
class ChatOutputMode:
    """How one request's choices are read; the same for each of its choices."""

    in_reasoning: bool | None  # None: the template does not think (no reasoning split at all)
    parse_tools: bool  # the request's tools may be called (tool_choice is not "none")
    forced_tool: str | None = None  # tool_choice named this function

    @classmethod
    def for_prompt(cls, tokenizer: GatewayTokenizer | None, prompt_token_ids: Sequence[int], *, parse_tools: bool,
                   forced_tool: str | None = None) -> ChatOutputMode:
        tags = think_tokens(tokenizer) if tokenizer is not None else None
        in_reasoning = None if tags is None else tags.opens_reasoning(prompt_token_ids)
        return cls(in_reasoning, parse_tools, forced_tool)

    def finish_reason(self, finish_reason: str | None, num_calls: int) -> str | None:
        """OpenAI says "tool_calls" when the model chose to call (not for a named tool_choice)."""
        if finish_reason == "stop" and num_calls and self.forced_tool is None:
            return "tool_calls"
        return finish_reason


@dataclass(slots=True)
class ChatPieces:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def delta(self) -> ChatDelta | None:
        """The OpenAI stream delta for these pieces, or None when there is nothing to send."""
        if not (self.reasoning or self.content or self.tool_calls):
            return None
        d = ChatDelta()
        if self.reasoning:
            d.reasoning_content = self.reasoning
        if self.content:
            d.content = self.content
        if self.tool_calls:
            d.tool_calls = self.tool_calls
        return d


class ChatOutputParser:
    def __init__(self, mode: ChatOutputMode):
        self.mode = mode
        self._reasoning = None if mode.in_reasoning is None else ReasoningParser(mode.in_reasoning)
        self._tools = ToolCallParser() if mode.parse_tools else None
        self.reasoning_text: list[str] = []
        self.content_text: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> ChatPieces:
        if self._reasoning is None:
            return self._answer("", text, final=False)
        reasoning, answer = self._reasoning.feed(text)
        return self._answer(reasoning, answer, final=False)

    def finish(self) -> ChatPieces:
        reasoning, answer = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._answer(reasoning, answer, final=True)

    def _answer(self, reasoning: str, answer: str, *, final: bool) -> ChatPieces:
        pieces = ChatPieces(reasoning=reasoning)
        if self._tools is None:
            pieces.content = answer
        else:
            events = self._tools.feed(answer) if answer else []
            if final:
                events += self._tools.finish()
            for e in events:
                if isinstance(e, Content):
                    pieces.content += e.text
                elif isinstance(e, CallStarted):
                    pieces.tool_calls.append(ToolCallDelta(e.index, FunctionCallDelta(name=e.name, arguments=""),
                                                           id=e.id, type="function"))
                elif isinstance(e, ArgumentsDelta):
                    pieces.tool_calls.append(ToolCallDelta(e.index, FunctionCallDelta(arguments=e.text)))
        if pieces.reasoning:
            self.reasoning_text.append(pieces.reasoning)
        if pieces.content:
            self.content_text.append(pieces.content)
        return pieces

    def message(self) -> AssistantMessage:
        """The whole message, once the text has ended (after ``finish``)."""
        calls = self.calls
        content = "".join(self.content_text)
        msg = AssistantMessage(content if content or not calls else None)
        if self.mode.in_reasoning is not None:
            reasoning = "".join(self.reasoning_text)
            msg.reasoning_content = reasoning if reasoning or self.mode.in_reasoning else None
        if calls:
            msg.tool_calls = [ToolCallOut(c.id, FunctionCallOut(c.name, c.arguments)) for c in calls]
        return msg


def parse_message(mode: ChatOutputMode, text: str) -> tuple[AssistantMessage, int]:
    """A complete choice's message and how many tool calls it holds."""
    parser = ChatOutputParser(mode)
    parser.feed(text)
    parser.finish()
    return parser.message(), len(parser.calls)
