"""The Responses API's translation (request -> chat request) and its event stream, checked against
the official SDK's own stream accumulator (what ``client.responses.stream`` runs)."""

import json

import msgspec
import openai
import pytest
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from deepinfer.runtime.gateway.chat_output import ChatOutputMode, ChatOutputParser
from deepinfer.runtime.gateway.errors import GatewayError
from deepinfer.runtime.gateway.openai_protocol import decode_request
from deepinfer.runtime.gateway.responses_api import (
    ResponseBuilder,
    make_response_usage,
    new_response,
)
from deepinfer.runtime.gateway.responses_request import ResponsesRequest, to_chat_request


def _req(**body) -> ResponsesRequest:
    return decode_request(json.dumps(body).encode(), ResponsesRequest)


def test_input_items_become_chat_messages():
    req = _req(model="m", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather"}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": "and tomorrow?"}],
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=9, reasoning={"effort": "high"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    chat = to_chat_request(req)
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("user", "weather?"), ("assistant", "Checking."), ("tool", "sunny"),
                     ("user", "and tomorrow?")]
    assert [(c.id, c.function.name) for c in chat.messages[2].tool_calls] == [("c1", "get_weather"),
                                                                              ("c2", "get_weather")]
    assert chat.messages[3].tool_call_id == "c1"
    assert chat.tool_choice.function.name == "get_weather" and chat.tools[0].function.name == "get_weather"
    assert chat.max_completion_tokens == 9 and chat.reasoning_effort == "high"
    assert chat.response_format.json_schema.schema == {"type": "object"}


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "input_image_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
])
def test_what_a_stateless_server_cannot_do_is_a_400(body, param):
    with pytest.raises(GatewayError) as err:
        to_chat_request(_req(**body))
    assert err.value.status == 400 and err.value.param == param


TEXT = ("weighing it</think>Let me call.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}"
        "<｜tool▁call▁end｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def _build(pieces_of_text: list[str]) -> tuple[ResponseBuilder, list[dict]]:
    builder = ResponseBuilder(new_response(_req(input="x"), "m"))
    parser = ChatOutputParser(ChatOutputMode(in_reasoning=True, parse_tools=True))
    events = builder.start()
    for piece in pieces_of_text:
        events += builder.add(parser.feed(piece))
    events += builder.add(parser.finish())
    events += builder.finish("completed", make_response_usage(5, 20, 0, 4))
    return builder, events


def test_events_fold_into_the_response_in_the_sdk():
    builder, events = _build([TEXT[i:i + 3] for i in range(0, len(TEXT), 3)])
    out = builder.response.output
    assert [o.type for o in out] == ["reasoning", "message", "function_call", "function_call"]
    assert out[0].content[0].text == "weighing it" and out[1].content[0].text == "Let me call."
    assert [(o.name, o.arguments) for o in out[2:]] == [("f", '{"a": 1}'), ("g", "{}")]
    assert all(o.status == "completed" for o in out) and builder.response.status == "completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for raw in events:
        wire = json.loads(msgspec.json.encode(raw))  # exactly what goes over the wire
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=wire))
    final = state._completed_response
    assert final is not None and final.id == builder.response.id and final.output_text == "Let me call."
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    # streamed in one piece or in many: the same items
    whole, _ = _build([TEXT])
    strip = lambda r: [(o.type, getattr(o, "name", None), json.dumps(msgspec.to_builtins(getattr(o, "content", None))))
                       for o in r.output]
    assert strip(whole.response) == strip(builder.response)


def test_incomplete_keeps_the_reason():
    builder = ResponseBuilder(new_response(_req(input="x", max_output_tokens=3), "m"))
    builder.start()
    parser = ChatOutputParser(ChatOutputMode(in_reasoning=None, parse_tools=False))
    builder.add(parser.feed("abc"))
    events = builder.finish("incomplete", make_response_usage(1, 3, 0, 0), "max_output_tokens")
    assert events[-1]["type"] == "response.incomplete"
    r = builder.response
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
    assert r.store is False and r.max_output_tokens == 3
