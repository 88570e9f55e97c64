"""Tokenizer wrapper: round trips, special tokens, chat templates like transformers, streaming."""

import json
import random

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from deepinfer.engine.text.chat_template import ChatTemplateError
from deepinfer.engine.text.tiny_tokenizer import (
    ASSISTANT,
    BOS,
    END_THINK,
    EOS,
    TOOL_SEP,
    USER,
    build_tokenizer,
    write_tokenizer_files,
)
from deepinfer.engine.text.tokenizer import OffsetDetokenizer, Tokenizer, TokenizerError

TEXTS = [
    "Hello world, this is a plain ASCII sentence.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "中文 模型 推理 — 日本語 こんにちは — Привет — Καλημέρα",
    "emoji 😀🚀🎉 and combining e\u0301 and rare 龘 鱻 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "code: def f(x):\n    return {'a': [1, 2, 3]}\n",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? 你好"},
    {"role": "assistant", "content": "4 😀"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, build_tokenizer(4096), model_max_length=16384)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_round_trip_and_special_tokens(tok):
    assert tok.vocab_size == 4096
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == (1,)
    assert tok.all_special_ids == frozenset(range(5))  # BOS EOS PAD User Assistant
    assert tok.control_token_ids == frozenset(range(14))  # + think and tool-call markup, decoded as text
    assert tok.decode([tok.token_to_id(END_THINK), tok.token_to_id(TOOL_SEP)]) == END_THINK + TOOL_SEP
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == BOS + text
    assert len(tok.encode("the model cache of the server", add_special_tokens=False)) <= 7  # BPE merges words


def test_same_ids_decodes_and_chat_as_transformers(tok, tok_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    for messages in (CHAT, CHAT[1:2], CHAT[:3]):
        for add in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=add)
            assert ours == hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
            assert tok.apply_chat_template(messages, add_generation_prompt=add, tokenize=True) == \
                hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=True, return_dict=True)["input_ids"]
    thinking = tok.apply_chat_template(CHAT[1:2], add_generation_prompt=True, thinking=True)
    assert thinking == hf.apply_chat_template(CHAT[1:2], add_generation_prompt=True, tokenize=False, thinking=True)


def test_chat_template_renders_deepseek_roles(tok):
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert text == (BOS + "You are terse." + USER + "What is 2+2? 你好" + ASSISTANT + END_THINK + "4 😀" + EOS
                    + USER + "And 3+3?" + ASSISTANT + END_THINK)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert ids.count(tok.bos_token_id) == 1 and ids[-2:] == [tok.token_to_id(ASSISTANT), tok.token_to_id(END_THINK)]


def test_chat_template_errors_are_one_line(tok, tok_dir, tmp_path):
    with pytest.raises(ChatTemplateError, match="unsupported chat role: function"):
        tok.apply_chat_template([{"role": "function", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="message 0"):
        tok.apply_chat_template(["not a message"])
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    bare = Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template(CHAT)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for %}"}))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT)


def test_template_sources_and_generation_eos(tok_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tok_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}"
                                                 "{% endfor %}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == '[user]"é<b>"'
    assert tok.eos_token_ids == (1, 4)


def test_missing_and_corrupt_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json.*skip_tokenizer_init"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)


def stream(detok, ids):
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


def test_streaming_never_splits_a_character(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces, tail = stream(tok.detokenizer(), ids)
        assert "".join(pieces) + tail == text
        assert tail == ""
        assert all("\ufffd" not in p for p in pieces)  # whole characters only
    # a rare character is several byte tokens: nothing comes out until its last byte arrives
    ids = tok.encode("龘", add_special_tokens=False)
    assert len(ids) > 1
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids] == [""] * (len(ids) - 1) + ["龘"]


def test_streaming_equals_decode_on_random_ids_with_specials(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(7) if rng.random() < 0.1 else rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        for skip in (True, False):
            pieces, tail = stream(tok.detokenizer(skip_special_tokens=skip), ids)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_offset_detokenizer_for_byte_fallback_tokenizers():
    """A SentencePiece-style tokenizer (Metaspace + byte fallback) streams through the generic path."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁hello", "▁world", "▁", "h", "e", "l", "o", "w", "r", "d"):
        vocab.setdefault(piece, len(vocab))
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(raw, {})
    text = "hello 你 world"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    assert isinstance(detok, OffsetDetokenizer)
    pieces, tail = stream(detok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert "你" in pieces and all("\ufffd" not in p for p in pieces)
    # after a prompt, the first generated word keeps its leading space
    prompt = tok.encode("hello")
    detok = tok.detokenizer(prompt_token_ids=prompt)
    assert "".join(detok.step(i) for i in tok.encode("world")) + detok.flush() == " world"
    assert tok.decode(tok.encode("world")) == "world"
