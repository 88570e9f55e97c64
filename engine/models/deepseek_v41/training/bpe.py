"""A byte-level BPE tokenizer trained on the training corpus, with the tiny tokenizer's control tokens.

Same layout as engine/text/tiny_tokenizer.py (DeepSeek's control and markup tokens at ids 0-13,
BOS prepended by the post-processor, the markup tokens decoding as text, the same chat template
written by ``write_tokenizer_files``); only the corpus differs. BPE training breaks ties by pair
order, so the same documents give the same tokenizer.json.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepinfer.engine.text.tiny_tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS, write_tokenizer_files
from deepinfer.engine.text.markup import BOS

__all__ = ["train_tokenizer", "write_tokenizer_files"]


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """BPE over ``documents`` to ``vocab_size`` tokens (the control tokens included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
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
