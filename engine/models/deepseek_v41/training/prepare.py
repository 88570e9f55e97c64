"""Prepare the training data directory (CPU only): corpus -> BPE tokenizer -> token streams -> n-gram baseline.

    DATA/
      tokenizer.json, tokenizer_config.json   the BPE tokenizer (chat template included)
      train.npy, calibration.npy, test.npy    uint16 token streams: each document is BOS + its ids + EOS
      headers.json                            held-out (test split) function headers: completion prompts
      manifest.json                           interpreter, seed, sizes, and the n-gram baseline on test

Training documents are shuffled with the seed; held-out files keep their order. The n-gram
baseline (interpolated Kneser-Ney, order 4, fitted on train) scores test tokens 1 .. L-1, the
positions the model is scored on too.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from deepinfer.engine.models.deepseek_v41.tiny_model import PADDED_IDS
from deepinfer.engine.models.deepseek_v41.training.bpe import train_tokenizer, write_tokenizer_files
from deepinfer.engine.models.deepseek_v41.training.corpus import SPLITS, function_headers, load_corpus
from deepinfer.engine.models.deepseek_v41.training.ngram import KneserNey
from deepinfer.engine.text.markup import BOS, EOS

NGRAM_ORDER = 4
NUM_HEADERS = 64
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class PrepareOptions:
    seed: int = 0
    vocab_size: int = 4096  # model vocabulary: the tokenizer has vocab_size - 16 tokens (16 padded ids)
    heldout_fraction: float = 0.04
    max_files: int | None = None  # a small corpus (tests)
    max_model_len: int = 16384


def prepare(out_dir: str | Path, options: PrepareOptions, log=print) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    corpus = load_corpus(options.seed, options.heldout_fraction, max_files=options.max_files)
    docs = {s: corpus.documents(s) for s in SPLITS}
    log(f"corpus: {corpus.root} (Python {corpus.python}): " +
        ", ".join(f"{s} {len(corpus.files[s])} files / {len(docs[s])} documents" for s in SPLITS))
    tokenizer = train_tokenizer(docs["train"], options.vocab_size - PADDED_IDS)
    write_tokenizer_files(out, tokenizer, model_max_length=options.max_model_len)
    random.Random(options.seed).shuffle(docs["train"])
    streams = {s: encode(tokenizer, docs[s]) for s in SPLITS}
    for s, ids in streams.items():
        np.save(out / f"{s}.npy", ids)
    headers = function_headers(corpus.files["test"], NUM_HEADERS)
    (out / "headers.json").write_text(json.dumps([asdict(h) for h in headers], indent=1) + "\n", encoding="utf-8")
    log("tokens: " + ", ".join(f"{s} {len(v):,}" for s, v in streams.items()) + f"; {len(headers)} held-out headers")
    baseline = KneserNey(streams["train"], options.vocab_size, NGRAM_ORDER)
    nll = float(-baseline.logprobs(streams["test"]).mean())
    manifest = {
        "python": corpus.python, "stdlib": corpus.root, "seed": options.seed, "vocab_size": options.vocab_size,
        "tokenizer_tokens": tokenizer.get_vocab_size(with_added_tokens=True),
        "heldout_fraction": options.heldout_fraction,
        "files": {s: len(corpus.files[s]) for s in SPLITS}, "documents": {s: len(docs[s]) for s in SPLITS},
        "tokens": {s: int(len(v)) for s, v in streams.items()},
        "bytes": {s: sum(len(d.encode()) for d in docs[s]) for s in SPLITS},
        "ngram": {"order": NGRAM_ORDER, "smoothing": "interpolated Kneser-Ney", "test_nll": nll,
                  "test_ppl": math.exp(nll)},
        "prepare_s": time.perf_counter() - start,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    log(f"n-gram baseline (order {NGRAM_ORDER} KN): test NLL {nll:.4f}, ppl {math.exp(nll):.2f}")
    return manifest


def encode(tokenizer: Tokenizer, docs: list[str]) -> np.ndarray:
    """BOS + ids + EOS of each document (the model learns to end a function), concatenated, as uint16."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    parts = [np.array([bos, *e.ids, eos], dtype=np.uint16)
             for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def load_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{data_dir} has no {MANIFEST}: run `deepinfer train-tiny --prepare-only` first")
    return json.loads(path.read_text(encoding="utf-8"))
