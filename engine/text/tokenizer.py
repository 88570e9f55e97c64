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
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders

from deepinfer.engine.text.chat_template import (
    ChatTemplateError,
    GuardedChat,
    render_chat,
    render_chat_guarded,
    select_template,
)
from deepinfer.engine.text.detokenizer import ByteLevelDetokenizer, OffsetDetokenizer, token_bytes_table

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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
        return self._encode_chat(chat)

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
        """A copy that tokenizes control-token strings as text (a copy: the flag is tokenizer
        state, and prompts are encoded on several threads). Added tokens are marked special in
        it, since ``encode_special_tokens`` leaves non-special ones matched."""
        data = json.loads(self._tok.to_str())
        for added in data.get("added_tokens", []):
            added["special"] = True
        tok = tokenizers.Tokenizer.from_str(json.dumps(data))
        tok.encode_special_tokens = True
        return tok

    def _encode_chat(self, chat: GuardedChat) -> list[int]:
        """Token ids of a guarded render: the control tokens found in ``chat.text`` are markup;
        each stretch between two of them that holds a placeholder is restored and re-encoded
        as text (the others keep their ids, so a conversation without control-token strings
        tokenizes exactly as its text does)."""
        encoding = self._tok.encode(chat.text, add_special_tokens=False)
        if chat.mark is None:
            return encoding.ids
        control = self.control_token_ids
        ids: list[int] = []
        stretch: list[int] = []
        start = 0

        def end_stretch(stop: int) -> None:
            segment = chat.text[start:stop]
            if chat.mark in segment:
                ids.extend(self._text_only.encode(chat.restore(segment), add_special_tokens=False).ids)
            else:
                ids.extend(stretch)

        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token_id in control:
                end_stretch(begin)
                ids.append(token_id)
                stretch, start = [], end
            else:
                stretch.append(token_id)
        end_stretch(len(chat.text))
        return ids
