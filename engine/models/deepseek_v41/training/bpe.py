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

import json

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepinfer.engine.text.tiny_tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS, write_tokenizer_files
from deepinfer.engine.text.markup import BOS

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
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])
    data = json.loads(tokenizer.to_str())
    for added in data["added_tokens"]:
        if added["content"] in MARKUP_TOKENS:
            added["special"] = False  # the trainer makes every added token special
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
