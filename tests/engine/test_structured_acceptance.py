"""Acceptance: random logits + the real sampler + grammar bitmasks must always give valid output.

A random "model" only stays inside a grammar if the mask works, so 30 generations (10 JSON
schemas, 10 regexes, 10 EBNF grammars) run concurrently through EngineCore and every result is
checked by an independent oracle: jsonschema, Python's re, or a small recursive-descent parser.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string

import jsonschema
import numpy as np
import pytest
import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.sample.structured_output import StructuredOutputBackend
from deepinfer.engine.sched.scheduler import SchedulerConfig
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

sync_steps = load_test_helper("bench/sync_steps")

# A byte-level-style vocabulary: every printable character plus multi-character merges that
# straddle grammar boundaries (so the mask must reason about partial matches).
VOCAB = ["<eos>"] + list(string.printable[:95]) + [
    '{"', '"}', '":', '", "', ", ", '": "', "true", "false", "null", "12", "00", "ab", "the", "in", "er",
    "com", "http", "://", "--", "()", "[]", "{}", "a,", "1.", "e+", "-1", "yes", " and ", "\n",
]
EOS = 0
NUM_PADDED = 5  # the model's vocabulary is larger than the tokenizer's, as with real checkpoints


class CharDetokenizer:
    def step(self, token_id: int) -> str:
        return "" if token_id == EOS or token_id >= len(VOCAB) else VOCAB[token_id]


class RandomLogitsRunner:
    """Logits are a hash of (sequence, position): random, but reproducible."""

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        rows = []
        for st in batch.steps:
            for t in range(st.end_pos - st.num_logits, st.end_pos):
                digest = hashlib.blake2b(f"{st.seq_id}:{t}".encode(), digest_size=8).digest()
                rows.append(np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(len(VOCAB) + NUM_PADDED))
        return torch.tensor(np.array(rows), dtype=torch.float32)


def _int(lo, hi):
    return {"type": "integer", "minimum": lo, "maximum": hi}


JSON_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": _int(0, 120)},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": _int(1, 999), "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
        "required": ["id", "tags"]}}, "required": ["user"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L"]}}, "required": ["color", "size"]},
    {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}}, "required": ["ok", "note"]},
    {"type": "array", "items": {"type": "object", "properties": {"x": _int(0, 9), "y": _int(0, 9)}, "required": ["x", "y"]},
     "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"version": {"const": "v1"},
                                      "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
     "required": ["version", "code"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "items": _int(0, 3), "maxItems": 2}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"anyOf": [_int(10, 20), {"type": "string", "enum": ["none"]}]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                                      "currency": {"enum": ["USD", "EUR"]}, "discount": {"type": "boolean"}},
     "required": ["price", "currency"]},
]

REGEXES = [
    r"[a-z]{3,8}",
    r"\d{3}-\d{4}",
    r"(cat|dog|bird)s?",
    r"[A-Z][a-z]{2,5} [A-Z][a-z]{2,5}",
    r"0x[0-9a-f]{4}",
    r"(ab)+c",
    r"\d{1,3}(\.\d{1,3}){3}",
    r"[a-z]+@[a-z]+\.(com|org)",
    r"(yes|no|maybe)!?",
    r"\(\d+(, \d+)*\)",
]


def _parse_arith(text: str) -> bool:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*; factor := digits | '(' expr ')'"""
    pos = 0

    def factor():
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            expr()
            if pos >= len(text) or text[pos] != ")":
                raise ValueError
            pos += 1
            return
        start = pos
        while pos < len(text) and text[pos].isdigit():
            pos += 1
        if pos == start:
            raise ValueError

    def chain(sub, ops):
        nonlocal pos
        sub()
        while pos < len(text) and text[pos] in ops:
            pos += 1
            sub()

    def expr():
        chain(lambda: chain(factor, "*/"), "+-")

    try:
        expr()
    except ValueError:
        return False
    return pos == len(text)


# (EBNF grammar, oracle)
GRAMMARS = [
    ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
     'factor ::= [0-9]+ | "(" expr ")"', _parse_arith),
    ('root ::= pair ("," pair)*\npair ::= [a-z]+ "=" [0-9]+', r"[a-z]+=[0-9]+(,[a-z]+=[0-9]+)*"),
    ('root ::= "(" "(" inner ")" ")"\ninner ::= [a-z] [a-z]?', r"\(\([a-z][a-z]?\)\)"),
    ('root ::= atom (" and " atom | " or " atom)*\natom ::= "true" | "false" | "not " atom',
     r"(not )*(true|false)(( and | or )(not )*(true|false))*"),
    ('root ::= year "-" month "-" day\nyear ::= [0-9] [0-9] [0-9] [0-9]\nmonth ::= "0" [1-9] | "1" [0-2]\n'
     'day ::= [0-2] [0-9] | "3" [01]', r"[0-9]{4}-(0[1-9]|1[0-2])-([0-2][0-9]|3[01])"),
    ('root ::= field ("," field)* "\\n"\nfield ::= [a-z0-9]*', r"[a-z0-9]*(,[a-z0-9]*)*\n"),
    ('root ::= "(" item (" " item)* ")"\nitem ::= [a-z]+ | "(" [a-z]+ (" " [a-z]+)* ")"',
     r"\((?:[a-z]+|\([a-z]+( [a-z]+)*\))( (?:[a-z]+|\([a-z]+( [a-z]+)*\)))*\)"),
    ('root ::= ("hello" | "hi") " " name "!"\nname ::= [A-Z] [a-z]*', r"(hello|hi) [A-Z][a-z]*!"),
    ('root ::= "[" (num ("," num)*)? "]"\nnum ::= "-"? [1-9] [0-9]*', r"\[(-?[1-9][0-9]*(,-?[1-9][0-9]*)*)?\]"),
    ('root ::= "https://" host ("/" seg)*\nhost ::= [a-z]+ "." ("com" | "org")\nseg ::= [a-z0-9]+',
     r"https://[a-z]+\.(com|org)(/[a-z0-9]+)*"),
]


def _check(kind, spec, oracle, text) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), spec)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if callable(oracle):
        return oracle(text)
    return re.fullmatch(oracle, text) is not None


@pytest.mark.timeout(300)
def test_random_model_always_produces_valid_structured_output():
    backend = StructuredOutputBackend(VOCAB, [EOS], vocab_size=len(VOCAB) + NUM_PADDED, any_whitespace=False)
    cfg = EngineCoreConfig(
        scheduler=SchedulerConfig(block_size=16, max_num_seqs=32, max_num_batched_tokens=2048, model_id="so"),
        num_blocks=1024,
        vocab_size=len(VOCAB) + NUM_PADDED,
        eos_token_ids=(EOS,),
    )
    core = EngineCore(RandomLogitsRunner(), cfg, detokenizer_factory=lambda prompt, params: CharDetokenizer(),
                      structured_output=backend, seed_rng=random.Random(0))
    cases = [("json", s, None) for s in JSON_SCHEMAS]
    cases += [("regex", r, r) for r in REGEXES]
    cases += [("grammar", g, oracle) for g, oracle in GRAMMARS]
    for i, (kind, spec, _) in enumerate(cases):
        params = SamplingParams(max_tokens=400, temperature=0.0 if i % 3 == 0 else 1.0, seed=i,
                                structured_outputs={kind: spec})
        core.add_request(f"q{i}", [1 + i % 20, 2, 3], params)
    results = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in sync_steps.step(core):
            results[out.request_id] = merge_output(results.get(out.request_id), out)
        core.check_integrity()
        steps += 1
        assert steps < 2000
    bad = []
    for i, (kind, spec, oracle) in enumerate(cases):
        out = results[f"q{i}"].outputs[0]
        if out.finish_reason != "stop" or not _check(kind, spec, oracle, out.text):
            bad.append((kind, spec if kind != "json" else i, out.finish_reason, out.text))
    assert not bad, bad
    texts = [results[f"q{i}"].outputs[0].text for i in range(len(cases))]
    assert len(set(texts)) == len(texts)  # the random model really explores
    assert sum(len(t) for t in texts) > 150


def test_oracles_reject_invalid_text():
    """The checks above are not vacuous: each oracle rejects a near miss."""
    assert not _check("json", JSON_SCHEMAS[0], None, '{"name": "bob", "age": 121}')
    assert not _check("json", JSON_SCHEMAS[2], None, '{"color": "pink", "size": "S"}')
    assert not _check("regex", None, REGEXES[1], "123-45")
    assert not _parse_arith("(1+2") and not _parse_arith("1+") and _parse_arith("(1+2)*3")
    assert not _check("grammar", None, GRAMMARS[4][1], "2024-13-01")
