"""The tokenizer of a model directory: tokenizer.json (+ tokenizer_config.json, chat template).

Wraps ``tokenizers.Tokenizer`` with what serving needs: encode/decode, special tokens and EOS
ids, an incremental detokenizer for streaming, and chat templates rendered as transformers
renders them (``apply_chat_template(messages, add_generation_prompt=True)``).

Where things come from (transformers' conventions):
- special tokens: ``bos_token``/``eos_token``/``pad_token``/``unk_token`` in tokenizer_config.json
  (a string or an ``{"content": ...}`` object);
- EOS ids: the eos_token plus ``eos_token_id`` of generation_config.json when present;
- chat template: ``chat_template.jinja``, else tokenizer_config.json ``chat_template``, else
  ``chat_template.json``.

Streaming text never shows half a character. Byte-level BPE tokenizers (GPT-2 style, DeepSeek's)
map every token to raw bytes, and a multi-byte UTF-8 character can span tokens:
``ByteLevelDetokenizer`` keeps the bytes of an unfinished character until the rest arrives (an
incremental UTF-8 decoder), so every emitted piece is whole text and the pieces concatenate to
``decode(ids)``; added tokens (special or not) are separate segments, as in the tokenizers
library: pending bytes are finished before them. Other tokenizers get ``OffsetDetokenizer``: it
decodes a short trailing window of ids and emits the new suffix once it no longer ends in U+FFFD
(an unfinished byte-fallback character).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders

from deepinfer.engine.text.chat_template import (
    ChatTemplateError,
    encode_guarded,
    render_chat,
    render_chat_guarded,
    select_template,
    text_only_tokenizer,
)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """Tokenizer files are missing or unusable; the one-line message says which and what to do."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):  # transformers' serialised AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self._tok = tokenizer
        config = dict(config or {})
        self.special_tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        self.chat_template = chat_template
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        # Llama-style configs ask for BOS in tokenizer_config.json; add it if the post-processor does not.
        bos = self.bos_token_id
        self._prepend_bos = bool(config.get("add_bos_token")) and bos is not None and (
            self._tok.encode("", add_special_tokens=True).ids[:1] != [bos])

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        path = Path(model_dir)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"model directory {str(path)!r} has no tokenizer.json; add one, or run from token "
                                 "ids with skip_tokenizer_init=True")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises bare Exceptions
            raise TokenizerError(f"{tokenizer_file} is not a valid tokenizers file: {exc}") from None
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif config.get("chat_template") is not None:
            template = config["chat_template"]
        elif (path / "chat_template.json").is_file():
            template = _read_json(path / "chat_template.json").get("chat_template")
        else:
            template = None
        try:
            template = select_template(template)
        except ChatTemplateError as exc:
            raise TokenizerError(f"{path}: {exc}") from None
        extra_eos: list[int] = []
        if (path / "generation_config.json").is_file():
            value = _read_json(path / "generation_config.json").get("eos_token_id")
            extra_eos = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
        return cls(tok, config, template, extra_eos)

    # ---- vocabulary ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (what xgrammar reads the vocabulary from)."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self._tok.token_to_id(text)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens["pad_token"]

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @cached_property
    def _added_tokens(self) -> dict[int, tokenizers.AddedToken]:
        return self._tok.get_added_tokens_decoder()

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._added_tokens.items() if t.special)

    # ---- text <-> ids ----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _token_bytes(self) -> list[bytes | None] | None:
        return token_bytes_table(self._tok) if isinstance(self._tok.decoder, decoders.ByteLevel) else None

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for: part of one UTF-8 character for a byte
        fragment (whose decoded text is only U+FFFD), so the bytes of a sequence's tokens
        concatenate to the UTF-8 of its text. Added tokens give their content; an id the model has
        but the tokenizer lacks (a padded vocabulary) gives no bytes, as it decodes to no text."""
        added = self._added_tokens.get(token_id)
        if added is not None:
            return added.content.encode("utf-8")
        table = self._token_bytes
        if table is not None:
            raw = table[token_id] if 0 <= token_id < len(table) else None
            return b"" if raw is None else raw  # an id past the tokenizer's (padded model vocab): no text
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        fallback = _BYTE_FALLBACK.fullmatch(piece)  # sentencepiece's <0xE2> byte tokens
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def detokenizer_for(self, prompt_token_ids: Sequence[int], params) -> ByteLevelDetokenizer | OffsetDetokenizer:
        """The output processor's ``DetokenizerFactory``: a request's detokenizer (its params'
        ``skip_special_tokens``)."""
        return self.detokenizer(params.skip_special_tokens, prompt_token_ids=prompt_token_ids)

    def decode_token(self, token_id: int) -> str:
        """One token's text with special tokens kept (logprob entries)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True,
                    prompt_token_ids: Sequence[int] = ()) -> ByteLevelDetokenizer | OffsetDetokenizer:
        """A fresh streaming detokenizer for the text generated after ``prompt_token_ids``:
        ``push(ids) -> new text`` (``step(id)`` for one), ``flush() -> tail`` at the end."""
        if self._token_bytes is not None:  # byte-level text does not depend on what came before
            return ByteLevelDetokenizer(self._token_bytes, self._tok.get_added_tokens_decoder(), skip_special_tokens)
        return OffsetDetokenizer(self._tok, skip_special_tokens, prompt_token_ids)

    # ---- chat ------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The prompt text for a conversation (as transformers renders it), or its token ids
        (``tokenize=True``): the template's markup gives the control tokens (none are added);
        text from messages and tools is tokenized as text, so a control-token string a user
        writes there (``<｜User｜>``) is never a control token."""
        template = chat_template or self.chat_template
        if template is None:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                                 "chat_template.jinja); send a plain prompt instead")
        if not tokenize:
            return render_chat(template, messages, add_generation_prompt, self.special_tokens, tools=tools, **kwargs)
        chat = render_chat_guarded(template, messages, self._control_tokens, add_generation_prompt,
                                   self.special_tokens, tools=tools, **kwargs)
        return encode_guarded(chat, self._tok, self.control_token_ids, lambda: self._text_only)

    @cached_property
    def control_token_ids(self) -> frozenset[int]:
        """Every added token: the special ones and the markup that decodes as text (``<think>``,
        tool-call markers). Only a chat template's own markup may produce them."""
        return frozenset(self._added_tokens)

    @cached_property
    def _control_tokens(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._added_tokens.values())

    @cached_property
    def _text_only(self) -> tokenizers.Tokenizer:
        return text_only_tokenizer(self._tok)


# ---- streaming detokenizers -------------------------------------------------------------
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte -> the byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    shifted to code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char2byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            char2byte[chr(256 + shifted)] = b
            shifted += 1
    return char2byte


def token_bytes_table(tokenizer: tokenizers.Tokenizer) -> list[bytes | None]:
    """Raw bytes of every regular token id of a byte-level tokenizer (None for added tokens)."""
    char2byte = byte_level_alphabet()
    added = tokenizer.get_added_tokens_decoder()
    table: list[bytes | None] = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = tokenizer.id_to_token(token_id)
        if token is None or token_id in added:
            table.append(None)
            continue
        is_byte_level = all(c in char2byte for c in token)
        table.append(bytes(char2byte[c] for c in token) if is_byte_level else token.encode("utf-8"))
    return table


class ByteLevelDetokenizer:
    def __init__(self, token_bytes: Sequence[bytes | None], added: dict[int, tokenizers.AddedToken],
                 skip_special_tokens: bool = True):
        self._token_bytes = token_bytes
        self._added = added
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Append token ids; return the text that became complete."""
        ids = (token_ids,) if isinstance(token_ids, int) else token_ids
        pieces = []
        for token_id in ids:
            added = self._added.get(token_id)
            if added is not None:
                if added.special and self._skip_special:
                    continue
                pieces.append(self._utf8.decode(b"", final=True))  # an added token ends the byte segment
                self._utf8.reset()
                pieces.append(added.content)
                continue
            raw = self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else None
            if raw is None:
                # an id the model has but the tokenizer lacks (checkpoints pad the vocabulary past
                # the tokenizer's): no text, as the tokenizers library decodes it; never an error
                # that would fail the whole step
                continue
            pieces.append(self._utf8.decode(raw))
        new_text = "".join(pieces)
        self.text += new_text
        return new_text

    def step(self, token_id: int) -> str:
        """One token (the engine's streaming protocol)."""
        return self.push(token_id)

    def flush(self) -> str:
        """End of stream: bytes of a character that never finished become U+FFFD."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self.text += tail
        return tail


class OffsetDetokenizer:
    # prompt tokens kept as decoding context: enough for a space or byte sequence to resolve
    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Decoders such as Metaspace drop the leading space of the first token, so continuation
        # text is decoded after a few prompt tokens that are never emitted themselves.
        self._ids: list[int] = list(context_ids[-self.CONTEXT_TOKENS:]) if context_ids else []
        self._prefix = 0  # ids[prefix:read] are already emitted (or context); decoding from prefix gives context
        self._read = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: int | Iterable[int]) -> str:
        self._ids.extend((token_ids,) if isinstance(token_ids, int) else token_ids)
        done = self._decode(self._ids[self._prefix: self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(done) or full.endswith(REPLACEMENT):
            return ""  # nothing new, or a character is still unfinished
        new_text = full[len(done):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new_text
        return new_text

    def step(self, token_id: int) -> str:
        return self.push(token_id)

    def flush(self) -> str:
        done = self._decode(self._ids[self._prefix: self._read])
        tail = self._decode(self._ids[self._prefix:])[len(done):]
        self._prefix = self._read = len(self._ids)
        self.text += tail
        return tail
