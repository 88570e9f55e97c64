"""Reasoning split from content (``<think>`` templates), whole and streamed, and the thinking switch."""

import random

import pytest
from msgspec import UNSET

from deepinfer.runtime.gateway.chat_output import ChatOutputMode, ChatOutputParser, parse_message
from deepinfer.runtime.gateway.reasoning import ReasoningParser, think_tokens
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")

CASES = [
    # (starts inside <think>, text, reasoning, content)
    (True, "let me see</think>The answer", "let me see", "The answer"),
    (True, "still thinking </thi", "still thinking </thi", ""),
    (True, "</think>", "", ""),
    (False, "<think>inner</think>outer", "inner", "outer"),
    (False, "  <think>a</think>b", "a", "b"),
    (False, "plain answer</think>more", "", "plain answer</think>more"),
    (False, "<thin", "", "<thin"),
    (False, "", "", ""),
]


@pytest.mark.parametrize("in_reasoning,text,reasoning,content", CASES)
def test_split_whole_and_in_any_pieces(in_reasoning, text, reasoning, content):
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        parser = ReasoningParser(in_reasoning)
        got_r, got_c = "", ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            r, c = parser.feed(text[a:b])
            got_r, got_c = got_r + r, got_c + c
        r, c = parser.finish()
        assert (got_r + r, got_c + c) == (reasoning, content)


def test_think_tags_are_read_off_the_prompt_tokens():
    tok = harness.tiny_tokenizer()
    tags = think_tokens(tok)
    assert tags is not None and tags.think_id == tok.token_to_id("<think>")
    chat = [{"role": "user", "content": "hi"}]
    thinking = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, thinking=True)
    plain = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert tags.opens_reasoning(thinking) and not tags.opens_reasoning(plain)
    # a user writing "<think>" opens nothing: the guard keeps it text
    assert not tags.opens_reasoning(tok.apply_chat_template([{"role": "user", "content": "<think>"}],
                                                            add_generation_prompt=True, tokenize=True))
    out = tok.encode("ab</think>cd", add_special_tokens=False)
    assert tags.num_reasoning_tokens(out, True) == out.index(tags.end_think_id) + 1
    assert tags.num_reasoning_tokens(out, False) == 0
    assert tags.num_reasoning_tokens(tok.encode("<think>x", add_special_tokens=False), False) == 2


def test_reasoning_then_tool_calls_in_one_message():
    mode = ChatOutputMode(in_reasoning=True, parse_tools=True)
    text = ("weigh it</think>Calling.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    msg, num_calls = parse_message(mode, text)
    assert (msg.reasoning_content, msg.content, num_calls) == ("weigh it", "Calling.", 1)
    assert (msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments) == ("f", '{"a": 1}')
    assert mode.finish_reason("stop", num_calls) == "tool_calls"
    assert ChatOutputMode(None, True, forced_tool="f").finish_reason("stop", 1) == "stop"  # named: OpenAI says stop
    assert mode.finish_reason("length", 1) == "length"
    # streamed one character at a time: the same pieces
    parser = ChatOutputParser(mode)
    deltas = [parser.feed(ch).delta() for ch in text] + [parser.finish().delta()]
    got = [d for d in deltas if d is not None]
    assert "".join(d.reasoning_content for d in got if d.reasoning_content is not UNSET) == "weigh it"
    assert "".join(d.content for d in got if d.content is not UNSET) == "Calling."
    calls = [c for d in got if d.tool_calls is not UNSET for c in d.tool_calls]
    assert calls[0].id == parser.calls[0].id and calls[0].function.name == "f"
    assert "".join(c.function.arguments for c in calls if c.function.arguments is not UNSET) == '{"a": 1}'
    # a template without think tags: no reasoning field at all, the text is all content
    plain, _ = parse_message(ChatOutputMode(None, False), "x</think>y")
    assert plain.reasoning_content is UNSET and plain.content == "x</think>y" and plain.tool_calls is UNSET
