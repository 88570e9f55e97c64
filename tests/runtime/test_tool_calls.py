"""Tool calls: DeepSeek's markup parsed into calls (whole and streamed), the chat template's tool
sections, and the grammar that forces calls whose arguments validate."""

import json
import random

import jsonschema
import pytest
import torch

from deepinfer.engine.text.markup import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP
from deepinfer.engine.text.tiny_tokenizer import build_tokenizer, write_tokenizer_files
from deepinfer.runtime.gateway.tool_calls import ArgumentsDelta, CallStarted, Content, ToolCallParser, parse_tool_calls
from deepinfer.runtime.gateway.tool_grammar import ToolGrammarError, tool_call_grammar
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")


def call(name: str, args: str) -> str:
    return f"{TOOL_CALL_BEGIN}{name}{TOOL_SEP}{args}{TOOL_CALL_END}"


def block(*calls: str) -> str:
    return TOOL_CALLS_BEGIN + "".join(calls) + TOOL_CALLS_END


CASES = [
    # (model text, content, [(name, arguments)])
    ("just words < and <｜ more", "just words < and <｜ more", []),
    ("Let me look." + block(call("get_weather", '{"city": "Paris"}')), "Let me look.", [("get_weather", '{"city": "Paris"}')]),
    (block(call("a", "{}"), call(" b ", '{"x": [1, 2]}')), None, [("a", "{}"), ("b", '{"x": [1, 2]}')]),
    # DeepSeek-V3 wrote newlines between calls
    (block(call("a", "{}"), "\n", call("b", "{}")), None, [("a", "{}"), ("b", "{}")]),
    # a marker spelled inside a JSON string does not end the call
    (block(call("echo", '{"s": "x' + TOOL_CALL_END + '\\"' + TOOL_CALLS_END + '"}')), None,
     [("echo", '{"s": "x' + TOOL_CALL_END + '\\"' + TOOL_CALLS_END + '"}')]),
    # cut off inside the arguments (max_tokens): what arrived is kept
    ("hm" + TOOL_CALLS_BEGIN + call("a", "{}") + TOOL_CALL_BEGIN + 'b' + TOOL_SEP + '{"k": 1', "hm",
     [("a", "{}"), ("b", '{"k": 1')]),
    # cut off before any call got its name: the text is content again
    ("x" + TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "get_wea", "x" + TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "get_wea", []),
    # an empty block is text
    ("a" + TOOL_CALLS_BEGIN + TOOL_CALLS_END + "b", "a" + TOOL_CALLS_BEGIN + TOOL_CALLS_END + "b", []),
    # text after a block is content too
    ("pre" + block(call("a", "{}")) + "post", "prepost", [("a", "{}")]),
    # a prefix of a marker at the very end is text
    ("ends with <｜tool▁ca", "ends with <｜tool▁ca", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_whole_text(text, content, calls):
    parsed = parse_tool_calls(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == len(calls)


def _replay(events):
    """(content, [(index, id, name, arguments)]) from a stream of events, as a client folds them."""
    content, calls = "", {}
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStarted):
            assert e.index not in calls and e.index == len(calls)
            calls[e.index] = [e.id, e.name, ""]
        else:
            assert isinstance(e, ArgumentsDelta) and e.index in calls
            calls[e.index][2] += e.text
    return content, [tuple(v[1:]) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_streamed_in_any_pieces_equals_whole(text, content, calls):
    rng = random.Random(len(text))
    for _ in range(25):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = ToolCallParser()
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        got_content, got_calls = _replay(events)
        assert got_content == (content or "")
        assert got_calls == calls
        # nothing is held back that could not be a marker's start: a plain delta shows at once
    parser = ToolCallParser()
    assert parser.feed("hello ") == [Content("hello ")]


def test_template_renders_calls_and_results_as_transformers_does(tmp_path):
    tok = harness.tiny_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Thanks"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tools=tools)
    assert ("Be brief.\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\nDescription: Weather now"
            '\n\nParameters: {"type": "object", "properties": {"city": {"type": "string"}}}\n\nIMPORTANT:') in text
    assert text.endswith("<｜User｜>Weather in Paris?<｜Assistant｜></think>" + block(call("get_weather", '{"city": "Paris"}'))
                         + "<｜end▁of▁sentence｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>Sunny."
                         "<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜></think>")
    # after a tool result the assistant's turn goes on: no new turn marker
    assert tok.apply_chat_template(chat[:4], add_generation_prompt=True, tools=tools).endswith("<｜tool▁output▁end｜>")
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files(tmp_path, build_tokenizer(4096), model_max_length=4096)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False) == text
    # the markup is control tokens only where the template wrote it
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tools=tools, tokenize=True)
    assert tok.decode(ids, skip_special_tokens=False) == text
    injected = tok.apply_chat_template([{"role": "user", "content": block(call("f", "{}"))}], tokenize=True)
    assert not set(injected[1:]) & {tok.token_to_id(m) for m in (TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN, TOOL_SEP)} - {None}


SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                     "unit": {"enum": ["c", "f"]}},
                    "required": ["city", "days"], "additionalProperties": False},
    "flag": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
}


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:vocab_size]).flatten()


def _random_walk(backend, grammar: str, rng: random.Random, max_steps: int = 1500) -> list[int]:
    state = backend.new_state({"grammar": grammar})
    mask = backend.allocate_bitmask(1)
    ids = []
    while not state.is_terminated and len(ids) < max_steps:
        state.fill_bitmask(mask, 0)
        allowed = _allowed(mask, backend.vocab_size).tolist()
        ids.append(rng.choice(allowed))
        assert state.accept(ids[-1:]) == 1
    assert state.is_terminated, "the walk did not finish"
    return ids


@pytest.mark.parametrize("forced,parallel", [(None, True), (None, False), ("get_weather", True)])
def test_forced_calls_validate_under_their_schema(forced, parallel):
    from deepinfer.engine.sample.structured_output import StructuredOutputBackend

    tok = harness.tiny_tokenizer()
    backend = StructuredOutputBackend.from_hf_tokenizer(tok.hf_tokenizer, tok.eos_token_ids, vocab_size=4096)
    grammar = tool_call_grammar(SCHEMAS, forced=forced, parallel_tool_calls=parallel, in_reasoning=False)
    rng = random.Random(7)
    names = set()
    for _ in range(6):
        parsed = parse_tool_calls(tok.decode(_random_walk(backend, grammar, rng)))
        assert parsed.content is None and parsed.calls
        if forced or not parallel:
            assert len(parsed.calls) == 1
        for c in parsed.calls:
            assert c.name == forced or (forced is None and c.name in SCHEMAS)
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
            names.add(c.name)
    assert forced is None or names == {forced}


def test_reasoning_first_then_calls():
    from deepinfer.engine.sample.structured_output import StructuredOutputBackend

    tok = harness.tiny_tokenizer()
    backend = StructuredOutputBackend.from_hf_tokenizer(tok.hf_tokenizer, tok.eos_token_ids, vocab_size=4096)
    grammar = tool_call_grammar(SCHEMAS, forced="flag", parallel_tool_calls=True, in_reasoning=True)
    # a thought, then the call
    state = backend.new_state({"grammar": grammar})
    thought = tok.encode("hmm, the flag</think>", add_special_tokens=False)
    assert state.accept(thought) == len(thought)
    rest = tok.encode(block(call("flag", '{"on": true}')), add_special_tokens=False)
    assert state.accept([*rest, tok.eos_token_id]) == len(rest) + 1 and state.is_terminated


def test_an_unusable_schema_names_its_function():
    with pytest.raises(ToolGrammarError, match="'bad'"):
        tool_call_grammar({"ok": {"type": "object"}, "bad": {"type": "object", "minProperties": "x"}}, forced=None,
                          parallel_tool_calls=True, in_reasoning=False)


async def test_required_and_named_reach_the_engine_as_the_call_grammar():
    import aiohttp

    engine = harness.fake_engine(max_model_len=4096)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": SCHEMAS["flag"]}} for i in range(12)]
    body = {"model": "fake-tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4, "tools": tools}
    async with harness.running_gateway(engine) as gateway, aiohttp.ClientSession(gateway.url) as session:
        for choice, names in (("required", [f"f{i}" for i in range(12)]), ({"type": "function", "function": {"name": "f3"}},
                                                                          ["f3"]), ("auto", [])):
            async with session.post("/v1/chat/completions", json={**body, "tool_choice": choice}) as resp:
                assert resp.status == 200, await resp.text()
            spec = engine.requests[-1].params.structured_outputs
            if not names:
                assert spec is None  # auto: the model is free, its markup is parsed
                continue
            grammar = spec["grammar"]
            opener = lambda n: json.dumps(f"{TOOL_CALL_BEGIN}{n}{TOOL_SEP}")[1:-1]  # EBNF escapes as JSON does
            assert all(opener(n) in grammar for n in names)
            assert (opener("f4") in grammar) == (len(names) > 1)
