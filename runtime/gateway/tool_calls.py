"""Tool calls in generated text: DeepSeek's markup (engine/text/markup.py) -> OpenAI ``tool_calls``.

``ToolCallParser`` reads the text of one choice as it streams and turns it into events: plain
content, the start of a call (its id and name) and pieces of a call's JSON arguments. The
complete response parses the whole text with the same parser, so a streamed choice and a
non-streamed one always agree. Markers are found in the text, so they must decode as text
(DeepSeek's tokenizers keep them out of the "special" tokens that decoding drops).

    content <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{args}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    ^^^^^^^ Content               ^ CallStarted(name) once the separator arrives, then ArgumentsDelta

Text that might be the start of a marker is held back until it is known not to be one. A
block cut off before any call got its name (``max_tokens``) comes back as content: nothing the
model wrote is lost; a call cut off inside its arguments keeps what arrived (``finish_reason``
"length" tells the client).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.text.markup import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    index: int  # the call's position among this choice's calls
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = Content | CallStarted | ArgumentsDelta


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_TEXT, _BLOCK, _NAME, _ARGS = range(4)  # outside a block, between calls, in a name, in arguments
_CALL_END_FIRST = TOOL_CALL_END[0]


class ToolCallParser:
    """Incremental parser of one choice's text; ``feed`` each delta, ``finish`` at the end."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._state = _TEXT
        self._buf = ""  # text not yet turned into events
        self._block_raw: str | None = None  # the current block as written, while no call in it has a name
        self._in_string = self._escaped = False  # where the arguments' JSON scan stands

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ToolEvent]:
        """Events for what is still held back (the text has ended)."""
        events = self.feed("")
        rest, self._buf = self._buf, ""
        if self._state == _TEXT and rest:
            events.append(Content(rest))
        elif self._state == _ARGS and rest:
            self._arguments(rest, events)
        elif self._state in (_BLOCK, _NAME) and self._block_raw is not None:
            # a block where no call got its name: give the model's text back as content
            events.append(Content(self._block_raw + rest))
        self._state = _TEXT
        return events

    # one transition per call; False when more text is needed
    def _step(self, events: list[ToolEvent]) -> bool:
        buf = self._buf
        if self._state == _TEXT:
            at = buf.find(TOOL_CALLS_BEGIN)
            if at < 0:
                keep = _held_prefix(buf, TOOL_CALLS_BEGIN)
                if len(buf) > keep:
                    events.append(Content(buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep :]
                return False
            if at:
                events.append(Content(buf[:at]))
            self._buf = buf[at + len(TOOL_CALLS_BEGIN) :]
            self._state, self._block_raw = _BLOCK, TOOL_CALLS_BEGIN
            return True
        if self._state == _BLOCK:
            stripped = buf.lstrip()  # DeepSeek-V3 put newlines between calls
            if stripped.startswith(TOOL_CALL_BEGIN):
                self._consume(len(buf) - len(stripped) + len(TOOL_CALL_BEGIN))
                self._state = _NAME
                return True
            if stripped.startswith(TOOL_CALLS_END):
                self._consume(len(buf) - len(stripped) + len(TOOL_CALLS_END))
                if self._block_raw is not None:  # an empty block: it was text after all
                    events.append(Content(self._block_raw))
                self._state, self._block_raw = _TEXT, None
                return True
            if not stripped or TOOL_CALL_BEGIN.startswith(stripped) or TOOL_CALLS_END.startswith(stripped):
                return False
            # junk between calls: skip to the next marker, or wait for one
            nxt = min((i for i in (buf.find(TOOL_CALL_BEGIN), buf.find(TOOL_CALLS_END)) if i >= 0), default=-1)
            if nxt < 0:
                self._consume(len(buf) - max(_held_prefix(buf, TOOL_CALL_BEGIN), _held_prefix(buf, TOOL_CALLS_END)))
                return False
            self._consume(nxt)
            return True
        if self._state == _NAME:
            at = buf.find(TOOL_SEP)
            if at < 0:
                return False
            call = ToolCall(new_call_id(), buf[:at].strip())
            self.calls.append(call)
            self._in_string = self._escaped = False
            events.append(CallStarted(len(self.calls) - 1, call.id, call.name))
            self._buf, self._state, self._block_raw = buf[at + len(TOOL_SEP) :], _ARGS, None
            return True
        return self._arguments_step(buf, events)

    def _arguments_step(self, buf: str, events: list[ToolEvent]) -> bool:
        """Arguments run to the first call-end marker outside a JSON string (a string value may
        spell a marker)."""
        for i, ch in enumerate(buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == _CALL_END_FIRST:
                if buf.startswith(TOOL_CALL_END, i):
                    if i:
                        self._arguments(buf[:i], events)
                    self._buf, self._state = buf[i + len(TOOL_CALL_END) :], _BLOCK
                    return True
                if TOOL_CALL_END.startswith(buf[i:]):  # maybe the marker: wait for the rest
                    if i:
                        self._arguments(buf[:i], events)
                    self._buf = buf[i:]
                    return False
        if buf:
            self._arguments(buf, events)
        self._buf = ""
        return False

    def _consume(self, n: int) -> None:
        if self._block_raw is not None:
            self._block_raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _arguments(self, text: str, events: list[ToolEvent]) -> None:
        self.calls[-1].arguments += text
        events.append(ArgumentsDelta(len(self.calls) - 1, text))


@dataclass(slots=True)
class ParsedText:
    content: str | None  # None when the model wrote only tool calls
    calls: list[ToolCall] = field(default_factory=list)


def parse_tool_calls(text: str) -> ParsedText:
    """A whole choice's text as content + calls (the streaming parser run once)."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return ParsedText(content if content or not parser.calls else None, parser.calls)


# ---- requests: tools and tool calls as the chat template reads them -----------------------------------
def template_tool_calls(calls: Iterable[Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as plain dicts (arguments as a JSON string)."""
    out = []
    for call in calls:
        arguments = call.function.arguments
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


def template_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """Function tools as the OpenAI-shaped dicts chat templates iterate over."""
    out = []
    for tool in tools:
        f = tool.function
        spec: dict[str, Any] = {"name": f.name}
        if f.description is not None:
            spec["description"] = f.description
        spec["parameters"] = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": spec})
    return out


def function_parameters(tools: Sequence[Any]) -> Mapping[str, dict[str, Any]]:
    """name -> the JSON schema of its arguments."""
    return {t.function.name: (t.function.parameters if t.function.parameters is not None else {"type": "object"})
            for t in tools}
