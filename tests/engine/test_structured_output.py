from __future__ import annotations

import json
import string
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepinfer.engine.sample.structured_output import (
    MAX_JSON_WHITESPACE,
    GrammarSpec,
    StructuredOutputBackend,
    StructuredOutputError,
)

VOCAB = ["<eos>"] + list(string.printable[:95]) + ['{"', '"}', '":', ", ", "true", "false", "null", "12", "ab"]
EOS = 0


def tok(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


@pytest.fixture(scope="module")
def backend():
    return StructuredOutputBackend(VOCAB, [EOS], vocab_size=len(VOCAB) + 7, any_whitespace=False)


def test_spec_canonicalises_json_schema():
    a = GrammarSpec.from_params({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    b = GrammarSpec.from_params({"json": '{"properties": {"a": {"type": "integer"}}, "type": "object"}'})
    assert a == b and a.kind == "json"
    assert GrammarSpec.from_params({"json_object": True}).kind == "json_object"


@pytest.mark.parametrize(
    "so, needle",
    [
        ({"regex": "a(b"}, "invalid regex: Regex parsing error"),
        ({"grammar": "root ::= foo"}, 'invalid EBNF grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
        ({"json": "{bad"}, "invalid JSON schema: not valid JSON"),
        ({"json": {"type": "nonsense"}}, 'invalid JSON schema: Unsupported type "nonsense"'),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "invalid JSON schema"),
        ({"json": []}, "invalid JSON schema: it must be a JSON object"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"xml": "x"}, "unknown structured output kind"),
    ],
)
def test_invalid_specs_are_one_line_typed_errors(backend, so, needle):
    with pytest.raises(StructuredOutputError) as e:
        backend.compile(so)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_compile_is_cached_and_thread_safe(backend):
    before = backend.num_compiles
    specs = [{"regex": f"x{i}[a-z]+"} for i in range(6)]
    with ThreadPoolExecutor(4) as ex:
        first = list(ex.map(backend.compile, specs * 4))
    assert backend.num_compiles - before <= 24  # concurrent first compiles may race...
    n = backend.num_compiles
    again = [backend.compile(s) for s in specs]
    assert backend.num_compiles == n  # ...but afterwards every compile is a cache hit
    assert all(a is b for a, b in zip(again, first[-6:]))  # one object per spec, racers included
    assert all(a is b for a, b in zip(first, first[6:]))


def test_lru_cache_is_bounded():
    b = StructuredOutputBackend(VOCAB, [EOS], cache_size=2)
    for i in range(4):
        b.compile({"regex": f"a{i}"})
    b.compile({"regex": "a3"})
    assert b.num_compiles == 4
    b.compile({"regex": "a0"})  # evicted: compiled again
    assert b.num_compiles == 5


def test_matcher_accept_rollback_terminate(backend):
    st = backend.new_state({"regex": "(cat|car)s"})
    mask = backend.allocate_bitmask(1)
    st.fill_bitmask(mask, 0)
    allowed = {v for v in range(len(VOCAB)) if (mask[0, v // 32] >> (v % 32)) & 1}
    assert allowed == {VOCAB.index("c")}
    assert st.accept(tok("cat")) == 3
    st.rollback(1)
    assert st.accept(tok("rx")) == 1  # "car" ok, "x" rejected
    assert st.accept(tok("s")) == 1 and not st.is_terminated
    assert st.accept([EOS]) == 1 and st.is_terminated
    with pytest.raises(ValueError):
        st.rollback(10)
    # the padded vocabulary tail (ids past the tokenizer's) is never allowed
    st2 = backend.new_state({"regex": "[a-z]+"})
    st2.fill_bitmask(mask, 0)
    assert all(not (mask[0, v // 32] >> (v % 32)) & 1 for v in range(len(VOCAB), len(VOCAB) + 7))


def test_bitmasks_for_drafts(backend):
    st = backend.new_state({"regex": "ab+c"})
    mask = backend.allocate_bitmask(4)
    st.fill_bitmasks_for_drafts(mask, 0, tok("abz"))
    def allowed(row):
        return {VOCAB[v] for v in range(len(VOCAB)) if (mask[row, v // 32] >> (v % 32)) & 1}
    assert allowed(0) == {"a", "ab"}
    assert allowed(1) == {"b"}
    assert allowed(2) == {"b", "c"}
    assert torch.all(mask[3] == -1)  # after the invalid draft "z": rows are rejected anyway
    assert st.num_accepted == 0  # rolled back to where it started
    assert st.accept(tok("abbc")) == 4


def test_json_object(backend):
    st = backend.new_state({"json_object": True})
    assert st.accept(tok('{"a": [1, true]}')) == len('{"a": [1, true]}')


def test_backend_from_a_tokenizers_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"name": "bob", "age": 12}', "hello world"] * 20, trainer)
    eos = tok.token_to_id("<eos>")
    b = StructuredOutputBackend.from_hf_tokenizer(tok, [eos], vocab_size=tok.get_vocab_size() + 3)
    st = b.new_state({"regex": "hello [a-z]+"})
    ids = tok.encode("hello world").ids
    assert st.accept(ids) == len(ids)
    assert st.accept(tok.encode(" 1").ids) == 0  # a digit cannot follow
    assert st.accept([eos]) == 1 and st.is_terminated



WS_VOCAB = VOCAB + ["\n", "\x0b"]


def ws_tok(text: str) -> list[int]:
    return [WS_VOCAB.index(c) for c in text]


def test_length_limited_json_strings_are_json_strings():
    """A string with maxLength admits escapes and no raw control characters (xgrammar 0.2.9's own
    rule admits them and no escapes, so the output would not parse as JSON)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 3}},
              "required": ["name"]}
    cases = [('{"name": "ab"}', True), ('{"name": "a\x0b"}', False), ('{"name": "a\\n"}', True),
             ('{"name": "\\u00e9x"}', True), ('{"name": "a\\"b"}', True), ('{"name": "abcd"}', False),
             ('{"name": ""}', False), ('{"name": "\\q"}', False)]
    backend = StructuredOutputBackend(WS_VOCAB, [EOS], vocab_size=len(WS_VOCAB), any_whitespace=False)
    for text, ok in cases:
        st = backend.new_state({"json": schema})
        ids = ws_tok(text)
        num = st.accept(ids)
        assert (num == len(ids) and st.accept([EOS]) == 1) == ok, text
        if ok:
            assert 1 <= len(json.loads(text)["name"]) <= 3


def test_json_schema_whitespace_runs_are_bounded():
    backend = StructuredOutputBackend(WS_VOCAB, [EOS], vocab_size=len(WS_VOCAB), any_whitespace=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    pretty = ws_tok('{\n    "a": 1\n}')
    st = backend.new_state({"json": schema})
    assert st.accept(pretty) == len(pretty) and st.accept([EOS]) == 1
    for blanks, ok in ((MAX_JSON_WHITESPACE, True), (MAX_JSON_WHITESPACE + 1, False)):
        st = backend.new_state({"json": schema})
        assert (st.accept(ws_tok("{" + " " * blanks)) == blanks + 1) == ok, blanks
