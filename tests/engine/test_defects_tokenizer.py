"""Tokenizer defects, through the real tiny tokenizer (and a byte-fallback one built here).

- ``token_bytes``: a token that is part of a UTF-8 character reports its raw bytes (its text
  alone is only U+FFFD), so the bytes of a sequence's tokens rebuild its exact text.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from deepinfer.engine.tiny_tokenizer import build_tokenizer, write_tokenizer_files
from deepinfer.engine.tokenizer import Tokenizer

TEXTS = ["€龍 rare 鱻 and 😀 emoji, café", "plain ascii text", "中文 模型 — Привет\n\tx"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, build_tokenizer(4096), model_max_length=4096)
    return Tokenizer.from_dir(path)


def _is_fragment(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_byte_level_token_bytes_rebuild_the_text(tok):
    num_fragments = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        raw = [tok.token_bytes(i) for i in ids]
        assert b"".join(raw) == text.encode("utf-8")
        for i, r in zip(ids, raw):
            if _is_fragment(r):
                num_fragments += 1
                assert "\ufffd" in tok.decode([i])  # the text the bytes used to be built from
    assert num_fragments >= 3
    assert tok.token_bytes(tok.eos_token_id) == tok.eos_token.encode("utf-8")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size + 5)


def test_byte_fallback_token_bytes():
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("▁", "a", "b", "ab", "▁ab"):
        vocab[piece] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("▁", "ab")], byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(raw)
    ids = tok.encode("ab é ab")
    assert [tok.token_bytes(i) for i in ids] == [b" ab", b" ", b"\xc3", b"\xa9", b" ab"]
