"""Incremental detokenization for streaming: text for each new token id, never half a character.

Byte-level BPE tokenizers (GPT-2 style, DeepSeek's) map every token to raw bytes; a multi-byte
UTF-8 character can span tokens. ``ByteLevelDetokenizer`` keeps the bytes of an unfinished
character until the rest arrives (an incremental UTF-8 decoder), so every emitted piece is whole
text and the pieces concatenate to ``tokenizer.decode(ids)``. Added tokens (special or not) are
separate segments, as in the tokenizers library: pending bytes are finished before them.

Other tokenizers use ``OffsetDetokenizer``: it decodes a short trailing window of ids and emits
the new suffix once it no longer ends in U+FFFD (an unfinished byte-fallback character).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

import tokenizers

REPLACEMENT = "\ufffd"


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
