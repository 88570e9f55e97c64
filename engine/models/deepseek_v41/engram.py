"""Engram: hashed n-gram memory added to the residual streams at the entry of a few layers.

Per position p and Engram layer: the token ids at p, p-1, ..., p-(n-1) (n = max n-gram size)
are mapped to a *compressed vocabulary* (tokens that normalise alike share one id); history
before the sequence (or before a replay's window start) is the pad token's id. For each order
2..n the ids are multiplied by per-layer odd multipliers and XOR-ed together (one running value),
then hashed per head with its own prime into its own disjoint range of the layer's table:

    column c = (order - 2) * heads + h,  row = (rolling mod prime[c]) + offset[c]

The rows (FP8 with one UE8M0 scale per 32 values, dequantised on lookup: the real table is far
too large to dequantise whole) are flattened, projected by ``wkv`` to one key per stream plus a
shared value, and each stream takes ``gate_k * value`` with a normalised, signed-sqrt gate.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepinfer.engine.models.deepseek_v4.layers import linear_holder
from deepinfer.kernels import ops

DIGIT_BASE = 256  # compressed ids ride in the SWA slot as base-256 digits (exact in bf16 too)
NUM_DIGITS = 3
GATE_FLOOR = 1e-6  # |dot| below this takes the floor before the square root


class EngramError(ValueError):
    """The tokenizer and the config disagree about the compressed vocabulary."""


# ---- compressed vocabulary -----------------------------------------------------------------
def _normaliser():
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # a private-use char: a token that is exactly one space survives the strip
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def compressed_token_map(tokenizer, vocab_size: int) -> tuple[list[int], int]:
    """(compressed id of every model token id ``0 .. vocab_size - 1``, number of compressed ids).

    ``tokenizer`` is a ``tokenizers.Tokenizer``. Each id is decoded alone (special tokens kept);
    a partial UTF-8 byte token is keyed by its raw token string, any other by its normalised text
    (or the text when that normalises to nothing); ids are numbered in first-seen order. Model
    ids past the tokenizer (a padded vocabulary) take the pad id later; here they map to 0."""
    normalise = _normaliser()
    keys: dict[str, int] = {}
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    lookup = [0] * max(vocab_size, num_tokens)
    for token_id in range(num_tokens):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalise.normalize_str(text) or text
        lookup[token_id] = keys.setdefault(key, len(keys))
    return lookup[:vocab_size], len(keys)


def token_map_from_dir(model_dir: str | Path, vocab_size: int, expected_size: int, pad_token_id: int) -> torch.Tensor:
    """The compressed-id table ``[vocab_size]`` int64 of a model directory's tokenizer.json; ids past
    the tokenizer map to the pad token's compressed id."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise EngramError(f"{model_dir} has no tokenizer.json; Engram layers hash n-grams of its normalised tokens")
    tokenizer = Tokenizer.from_file(str(path))
    lookup, size = compressed_token_map(tokenizer, vocab_size)
    if size != expected_size:
        raise EngramError(f"{path} normalises to {size} compressed tokens but config engram_compressed_vocab_size "
                          f"is {expected_size}: the Engram hashes would not match the checkpoint's table")
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    pad = lookup[pad_token_id]
    for i in range(num_tokens, vocab_size):
        lookup[i] = pad
    return torch.tensor(lookup, dtype=torch.int64)


# ---- hash layout ---------------------------------------------------------------------------
def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=8)
def hash_primes(num_layers: int, max_ngram: int, num_heads: int, search_start: int) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer the ``(max_ngram - 1) * num_heads`` primes, column order: for each layer
    and order the search restarts just below ``search_start``; a prime is never used twice."""
    used: set[int] = set()
    layers = []
    for _ in range(num_layers):
        cols = []
        for _ in range(max_ngram - 1):
            current = search_start - 1
            for _ in range(num_heads):
                current += 1
                while not _is_prime(current) or current in used:
                    current += 1
                used.add(current)
                cols.append(current)
        layers.append(tuple(cols))
    return tuple(layers)


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """``[num_layers, max_ngram]`` odd int64 multipliers, one seeded generator per layer id, bounded
    so that ``id * multiplier`` never overflows."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * lid).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for lid in layer_ids]
    return np.stack(rows)


class EngramHash(nn.Module):
    """Token ids -> table rows of every Engram layer; holds the compressed-id table."""

    def __init__(self, config, device=None):
        super().__init__()
        c = config
        self.max_ngram = c.engram_max_ngram_size
        # the table sizes were checked against these primes with the config (config.py)
        primes = hash_primes(len(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
        offsets = [np.cumsum([0, *cols[:-1]]) for cols in primes]
        # the loader fills the table from the tokenizer (engram.token_map_from_dir)
        self.register_buffer("token_map", torch.zeros(c.vocab_size, dtype=torch.int64, device=device))
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("offsets", torch.tensor(np.array(offsets), dtype=torch.int64, device=device),
                             persistent=False)
        mult = hash_multipliers(tuple(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_compressed_vocab_size)
        self.register_buffer("multipliers", torch.from_numpy(mult).to(device), persistent=False)
        self.pad_token_id = c.engram_pad_token_id

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T, max_ngram]`` compressed ids of (p, p-1, ...), -1 where blocked -> rows
        ``[T, num_layers, columns]``."""
        pad = self.token_map[self.pad_token_id]
        blocked = (ids < 0).cummax(dim=1).values  # blocked once stays blocked for longer n-grams
        tokens = torch.where(blocked, pad, ids)
        products = tokens[:, None, :] * self.multipliers[None]  # [T, layers, max_ngram]
        rolling, hashes = products[..., 0], []
        num_heads = self.primes.shape[1] // (self.max_ngram - 1)
        for i in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            cols = self.primes[:, (i - 1) * num_heads : i * num_heads]
            hashes.append(rolling[..., None] % cols)
        return torch.cat(hashes, dim=-1) + self.offsets


def ids_to_digits(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Compressed ids (-1 = none) -> ``[T, NUM_DIGITS]`` base-256 digits of ``id + 1`` in ``dtype``."""
    v = ids + 1
    digits = [(v // DIGIT_BASE**k) % DIGIT_BASE for k in range(NUM_DIGITS)]
    return torch.stack(digits, dim=-1).to(dtype)


def digits_to_ids(digits: torch.Tensor) -> torch.Tensor:
    v = digits.round().long()
    return sum(v[..., k] * DIGIT_BASE**k for k in range(NUM_DIGITS)) - 1


class Engram(nn.Module):
    """One Engram layer's table, projection and gate weights."""

    def __init__(self, config, index: int, device=None, dtype=None, numerics=None):
        super().__init__()
        c = config
        self.act = (lambda x: x) if numerics is None else numerics.act  # wkv is FP8: its input rounds
        self.index = index  # position among the config's Engram layers
        self.hc_mult, self.hidden, self.eps = c.hc_mult, c.hidden_size, c.rms_norm_eps
        self.head_dim = c.engram_head_dim
        columns = (c.engram_max_ngram_size - 1) * c.engram_n_heads
        rows = c.engram_num_embeddings[index]
        # FP8 checkpoints keep the table in FP8 (rows dequantised on lookup); others in `dtype`
        table_dtype = torch.float8_e4m3fn if c.quantization is not None else dtype
        self.register_buffer("embed", torch.zeros(rows, self.head_dim, dtype=table_dtype, device=device))
        self.register_buffer("embed_scale", torch.ones(rows, self.head_dim // 32, dtype=torch.float32, device=device))
        self.wkv = linear_holder(columns * self.head_dim, c.hidden_size * (c.hc_mult + 1), device, dtype)
        f32 = dict(device=device, dtype=torch.float32)
        self.q_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, **f32), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, **f32), requires_grad=False)

    def lookup(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantised table rows ``[T, columns * head_dim]`` in ``dtype`` (exact: e4m3 x 2^k)."""
        t, cols = rows.shape
        flat = rows.reshape(-1)
        values = self.embed.index_select(0, flat).float().view(t * cols, -1, 32)
        scale = self.embed_scale.index_select(0, flat)
        return (values * scale[:, :, None]).view(t, cols * self.head_dim).to(dtype)

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, num_tokens: int, batch_invariant: bool,
                dead: torch.Tensor | None = None) -> torch.Tensor:
        """``streams [R, hc, D]``; ``rows [T, columns]`` this layer's table rows for the first T
        rows of ``streams`` (padding rows pass through); ``dead [T]``: image tokens, whose gate is 0."""
        t, d = num_tokens, self.hidden
        kv = ops.linear(self.act(self.lookup(rows, streams.dtype)), self.wkv.weight, batch_invariant)
        key = kv[:, : self.hc_mult * d].float().view(t, self.hc_mult, d)
        value = kv[:, self.hc_mult * d :].float()
        x = streams[:t].float()
        weight = self.q_weight * self.k_weight
        # normalised per (token, stream) over D, not jointly over the streams
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * weight * key).sum(-1) * rstd * d**-0.5
        gate = ops.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot), batch_invariant)
        if dead is not None:
            gate = gate.masked_fill(dead[:, None], 0.0)
        out = streams.clone()
        out[:t] = (x + gate[..., None] * value[:, None, :]).to(streams.dtype)
        return out

