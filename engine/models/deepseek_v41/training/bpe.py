"""A byte-level BPE tokenizer trained on the training corpus, with the tiny tokenizer's control tokens.

Same layout as engine/text/tiny_tokenizer.py (DeepSeek's control and markup tokens at ids 0-13,
BOS prepended by the post-processor, the markup tokens decoding as text, the same chat template
written by ``write_tokenizer_files``); only the corpus differs. BPE training breaks ties by pair
order, so the same documents give the same tokenizer.json.

Pre-tokenization keeps every newline and a line's leading indentation as pieces of their own
(then GPT-2's byte-level split): with the plain byte-level split "\n" merges with the next line's
indentation ("\n    " is one token), so a prompt that ends in a newline ends on a token that in
training only ever preceded column-0 text, and the model answers a ``def f(x):\n`` header with
a comment or EOS. Split this way, the tokens of a text never cross a line start, and a prompt
cut after its newline or its indentation ends on a boundary the model has seen.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, pre_tokenizers

from deepinfer.engine.text.tiny_tokenizer import train_bpe, write_tokenizer_files

__all__ = ["LINE_START", "pre_tokenizer", "train_tokenizer", "write_tokenizer_files"]

# a newline, or the spaces/tabs that open a line (``^`` is a line anchor in the tokenizers' regex)
LINE_START = r"\n|^[ \t]+"


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LINE_START), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """BPE over ``documents`` to ``vocab_size`` tokens (the control tokens included)."""
    return train_bpe(documents, vocab_size, pre_tokenizer())
